"""orchestrator (BLS): prefill pool -> first token streamed at once -> decode pool with the KV
payload -> tokens streamed as text. Falls back to decode's own prefill when the prefill pool
fails or times out. Requests run concurrently on a thread pool.

The same code serves two configs: `orchestrator` (decoupled: streaming, for gRPC streams and
generate_stream) and `orchestrator_sync` (one response per request, for KServe v2 /infer,
which Triton's HTTP endpoint refuses for decoupled models)."""

import dataclasses
from pathlib import Path

from disagg import heartbeat
from disagg.cancel import CancelRegistry
from disagg.codec.generate import OrchestratorRequest
from disagg.engine.config import load_model_args
from disagg.engine.tokenizer import Tokenizer
from disagg.model_params import OrchestratorParams
from disagg.pipeline.conditional import CostModel, CostParams
from disagg.pipeline.orchestrator import Orchestrator
from disagg.pipeline.prefix_locality import PrefixLocality
from disagg.pipeline.request import build_request
from disagg.triton import bls, pb, pb_metrics, pools, runner

BATCHED = True  # max_batch_size > 0: tensors carry a batch dimension (of 1)


def route_params(p: OrchestratorParams):
    """How the replicas of a pool on other servers are chosen (remote/cache_route.py)."""
    from disagg.remote.cache_route import RouteParams

    return RouteParams(
        choice=p.replica_choice,
        load_weight=p.replica_load_weight,
        overload=p.replica_overload,
        block_size=p.engine_config().block_size,
        capacity_tokens=p.prefix_cache_tokens,
    )


class TritonPythonModel:
    def initialize(self, args):
        pb.configure_logging()
        p = pb.model_parameters(args).typed(OrchestratorParams)
        self.decoupled = pb.is_decoupled(args)
        self.model_name = args["model_name"]  # orchestrator or orchestrator_sync
        self.tokenizer = Tokenizer(p.engine_dir)
        self.max_tokens_default = p.max_tokens_default
        cancels = CancelRegistry(Path(p.run_dir) / "cancel")
        metrics = pb_metrics.OrchestratorMetrics(args["model_name"])
        cost = CostParams(
            remote_stall=p.conditional_remote_stall,
            prefill_instances=p.prefill_instances,
        )
        self.orchestrator = Orchestrator(
            self.tokenizer,
            load_model_args(p.engine_dir),
            p.engine_config(),
            prefill_pool=self._prefill_pool(p, cancels),
            decode_pool=self._decode_pool(p, cancels),
            mode=p.mode,
            events=metrics,
            cost_model=CostModel(cost),
            # a failed decode is continued by another replica or instance, or the restarted one
            migration_limit=p.migration_limit,
            decode_recover_s=p.decode_recover_s,
            # where this server's pools left each prompt's K/V (pools elsewhere are followed
            # per replica: remote/cache_route.py; which of several decode instances Triton
            # hands a request to is not known here)
            locality=None
            if p.prefill_replicas or p.decode_replicas
            else PrefixLocality(p.prefix_cache_tokens, track_decode=p.decode_instances == 1),
        )
        self.replica_metrics = pb_metrics.ReplicaMetrics(
            {
                pool: getattr(getattr(self.orchestrator, f"{pool}_pool"), "replicas", None)
                for pool in ("prefill", "decode")
            }
        )
        self.runner = runner.RequestRunner(
            self.decoupled,
            p.orchestrator_max_concurrency,
            parse=self._parse,
            run=self.orchestrator.run,
            respond=lambda reply, requested=frozenset(): pb.reply_response(
                reply, BATCHED, requested
            ),
            on_error=lambda kind: metrics.error("request", kind),
            cancels=cancels,  # a cancel mark on its caller's id (the router's) cancels it
        )
        heartbeat.start(Path(p.run_dir) / "heartbeat")  # last: a stub still loading is not judged

    @staticmethod
    def _prefill_pool(p: OrchestratorParams, cancels: CancelRegistry):
        if p.prefill_replicas:  # on other servers, over gRPC
            from disagg.remote.pools import GrpcPrefillPool

            return GrpcPrefillPool(
                p.prefill_replicas,
                timeout_s=p.prefill_timeout_s,
                cancels=cancels,
                route=route_params(p),
            )
        return pools.BlsPrefillPool(p.prefill_model, p.prefill_timeout_s)

    @staticmethod
    def _decode_pool(p: OrchestratorParams, cancels: CancelRegistry):
        if p.decode_replicas:
            from disagg.remote.pools import GrpcDecodePool

            return GrpcDecodePool(p.decode_replicas, route=route_params(p), hang_s=p.decode_hang_s)
        return pools.BlsDecodePool(p.decode_model, cancels, hang_s=p.decode_hang_s)

    def _parse(self, request):
        req = build_request(
            OrchestratorRequest.decode(
                pb.client_inputs(request, OrchestratorRequest.TENSORS, self.model_name)
            ),
            self.tokenizer,
            self.max_tokens_default,
            caller_id=request.request_id(),
        )
        self.orchestrator.check_request(req)
        return req if self.decoupled else dataclasses.replace(req, stream=False)

    def execute(self, requests):
        return self.runner.execute(requests)

    def finalize(self):
        self.replica_metrics.stop()
        for pool in (self.orchestrator.prefill_pool, self.orchestrator.decode_pool):
            if hasattr(pool, "replicas"):  # stop following their KV events
                pool.replicas.close()
        self.runner.shutdown()
        bls.FINISHED_STREAMS.clear()  # before the stub exits, as below
        pb_metrics.close_metrics()  # before the stub exits (see pb_metrics.close_metrics)
