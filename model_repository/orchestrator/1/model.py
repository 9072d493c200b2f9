"""orchestrator (BLS): prefill pool -> first token streamed at once -> decode pool with the KV
payload -> tokens streamed as text. Falls back to decode's own prefill when the prefill pool
fails or times out. Requests run concurrently on a thread pool.

The same code serves two configs: `orchestrator` (decoupled: streaming, for gRPC streams and
generate_stream) and `orchestrator_sync` (one response per request, for KServe v2 /infer,
which Triton's HTTP endpoint refuses for decoupled models)."""

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from disagg.cancel import CancelRegistry
from disagg.config import load_model_args
from disagg.tokenizer import Tokenizer
from disagg.triton import pb
from disagg.triton import protocol as P
from disagg.triton.orchestrator import Orchestrator, build_request

INPUTS = {
    P.INPUT_IDS: "ints",
    P.TEXT_INPUT: "str",
    P.MAX_TOKENS: "int",
    P.STREAM: "bool",
    P.TEMPERATURE: "float",
    P.TOP_K: "int",
    P.TOP_P: "float",
    P.SEED: "int",
    P.STOP_WORDS: "strs",
    P.BAD_WORDS: "strs",
    P.END_ID: "int",
    P.PAD_ID: "int",
    P.EXCLUDE_INPUT_IN_OUTPUT: "bool",
    P.RETURN_NUM_INPUT_TOKENS: "bool",
    P.RETURN_NUM_OUTPUT_TOKENS: "bool",
}
BATCHED = True  # max_batch_size > 0: tensors carry a batch dimension (of 1)
log = logging.getLogger("disagg.orchestrator")


class TritonPythonModel:
    def initialize(self, args):
        p = pb.model_parameters(args)
        self.decoupled = pb.is_decoupled(args)
        self.tokenizer = Tokenizer(p["engine_dir"])
        self.max_tokens_default = int(p["max_tokens_default"])
        config = pb.engine_config(p)
        cancels = CancelRegistry(Path(p["run_dir"]) / "cancel")
        self.orchestrator = Orchestrator(
            self.tokenizer,
            load_model_args(p["engine_dir"]),
            config,
            prefill_pool=pb.BlsPrefillPool(p["prefill_model"], float(p["prefill_timeout_s"])),
            decode_pool=pb.BlsDecodePool(p["decode_model"], cancels),
            mode=p["mode"],
        )
        self.workers = ThreadPoolExecutor(int(p["max_concurrency"]), "orchestrator")

    def _parse(self, request):
        req = build_request(
            pb.read_fields(request, INPUTS, BATCHED), self.tokenizer, self.max_tokens_default
        )
        self.orchestrator.check_request(req)
        return req if self.decoupled else dataclasses.replace(req, stream=False)

    def execute(self, requests):
        if not self.decoupled:
            return list(self.workers.map(self._run_sync, requests))
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = self._parse(request)
            except Exception as e:
                sender.send(pb.error_response(e), flags=pb.FINAL)
                continue
            self.workers.submit(self._run_streaming, req, sender)
        return None

    def _run_sync(self, request):
        try:
            final = self.orchestrator.run(self._parse(request), emit=lambda reply: None)
            return pb.reply_response(final, BATCHED)
        except Exception as e:
            return pb.error_response(e)

    def _run_streaming(self, req, sender):
        try:
            final = self.orchestrator.run(
                req,
                emit=lambda reply: sender.send(pb.reply_response(reply, BATCHED)),
                is_cancelled=sender.is_cancelled,
            )
            sender.send(pb.reply_response(final, BATCHED), flags=pb.FINAL)
        except Exception as e:
            log.warning("request %s failed: %s", req.request_id, e)
            try:
                sender.send(pb.error_response(e), flags=pb.FINAL)
            except Exception:
                log.exception("request %s: could not report the failure", req.request_id)

    def finalize(self):
        self.workers.shutdown(wait=False, cancel_futures=True)
