"""router (BLS): the single entry point for generation. Same inputs and outputs as `ensemble`
plus routing hints; the policy (policy.toml next to this model, reloaded when it changes)
and the endpoints' live state choose the local pipeline or an external OpenAI-compatible
endpoint (the LPU pool), with fallback to the local pipeline.

The same code serves `router` (decoupled: streaming) and `router_sync` (one response per
request, for KServe v2 /infer)."""

from pathlib import Path

from disagg import contracts as C
from disagg import heartbeat
from disagg.cancel import CancelRegistry
from disagg.codec.generate import RouterRequest
from disagg.engine.tokenizer import Tokenizer
from disagg.model_params import RouterParams
from disagg.routing.policy import PolicySource
from disagg.routing.request import build_route_request
from disagg.routing.router import Router
from disagg.triton import bls, local_pipeline, pb, pb_metrics, runner

BATCHED = True


class TritonPythonModel:
    def initialize(self, args):
        pb.configure_logging()
        p = pb.model_parameters(args).typed(RouterParams)
        self.decoupled = pb.is_decoupled(args)
        self.model_name = args["model_name"]  # router or router_sync
        self.tokenizer = Tokenizer(p.engine_dir)
        self.default_model = p.served_model_name
        self.max_tokens_default = p.max_tokens_default
        cancels = CancelRegistry(Path(p.run_dir) / "cancel")
        self.router = Router(
            PolicySource(p.router_policy),  # an invalid policy fails the model load, loudly
            local_pipeline.BlsLocalPipeline(cancels),
            count_tokens=lambda text: len(self.tokenizer.encode(text)),
            events=pb_metrics.RouterMetrics(),
        )
        self.runner = runner.RequestRunner(
            self.decoupled,
            p.orchestrator_max_concurrency,
            parse=self._parse,
            run=self.router.run,
            respond=lambda reply, requested=frozenset(): pb.routed_response(
                reply, BATCHED, requested
            ),
            # a client that leaves is marked at once, mid-prefill too (cancel.CancelWatch)
            cancels=cancels,
        )
        heartbeat.start(Path(p.run_dir) / "heartbeat")  # last: a stub still loading is not judged

    def _parse(self, request):
        fields = RouterRequest.decode(
            pb.client_inputs(request, RouterRequest.TENSORS, self.model_name)
        )
        if not self.decoupled:
            fields[C.STREAM] = False
        return build_route_request(
            fields,
            self.tokenizer,
            self.default_model,
            self.max_tokens_default,
            client_request_id=request.request_id(),
        )

    def execute(self, requests):
        return self.runner.execute(requests)

    def finalize(self):
        self.runner.shutdown()
        bls.FINISHED_STREAMS.clear()  # before the stub exits, as below
        pb_metrics.close_metrics()  # before the stub exits (see pb_metrics.close_metrics)
