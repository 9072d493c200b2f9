"""In-process pools: the orchestrator's PrefillPool and DecodePool over engines in this process.

The same hand-off as between Triton models: prefill packs the prompt's K/V into payload
bytes, decode parses and verifies them (`prefill_result`, shared with the decode model), and
decode's output arrives as DecodeSteps, the first one an acknowledgement. `disagg.llm` is the
orchestrator over these pools; a remote pool is a third implementation of the same two
Protocols (orchestrator.py).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from disagg.contracts import DecodeStep, Handoff
from disagg.engine.sequence import SamplingParams, TokenLogprob
from disagg.errors import PoolError, RequestError

if TYPE_CHECKING:  # the engines bring torch
    from disagg.engine.llm_engine import PrefillEngine, PrefillResult
    from disagg.pipeline.decode_service import DecodeService

log = logging.getLogger("disagg.pipeline")


def prefill_result(
    request_id: str, first_token: int, seed: int, payload: memoryview | bytes
) -> PrefillResult:
    """What decode imports: the PrefillResult a KV payload's bytes (disagg's KVPayload, or
    TensorRT-LLM's DisaggregatedParams) describe. Raises KVPayloadError for bad bytes."""
    from disagg.engine.kv_payload import KVPayload
    from disagg.engine.llm_engine import PrefillResult
    from disagg.trtllm import payload as trtllm_payload

    if trtllm_payload.is_trtllm_payload(payload):
        # TensorRT-LLM's decode engine takes its own hand-off where PrefillResult types ours
        handoff = trtllm_payload.from_bytes(payload)
        return PrefillResult(request_id, first_token, handoff, seed, 0.0)  # type: ignore[arg-type]
    return PrefillResult(request_id, first_token, KVPayload.from_bytes(payload), seed, 0.0)


class LocalPrefillPool:
    """One prefill worker: requests take turns, as in a pool of one process."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()

    def prefill(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, skip_tokens: int = 0
    ) -> Handoff:
        with self._lock:
            start_wall = time.time()
            try:
                result = self.engine.prefill(request_id, prompt_ids, params, skip_tokens)
            except RequestError:
                raise
            except Exception as e:  # the pool's failure: the orchestrator falls back
                raise PoolError(f"prefill: {e}") from e
        return Handoff(
            first_token=result.first_token,
            seed=result.seed,
            kv_payload=result.kv.pack(),
            worker_pid=os.getpid(),
            prefill_time_s=result.prefill_time_s,
            start_wall_s=start_wall,
            num_cached_tokens=result.num_reused_tokens,
            kv_start=result.kv.start,
            first_logprob=result.first_logprob,
        )


class _QueueSink:
    """DecodeService's Sink for one request: its output as DecodeSteps on a queue."""

    def __init__(self) -> None:
        self.steps: queue.Queue[DecodeStep | Exception] = queue.Queue()
        self.cancelled = threading.Event()

    def send(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        num_cached_tokens: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        step = DecodeStep(list(token_ids), finish_reason, os.getpid(), num_cached_tokens, logprobs)
        self.steps.put(step)

    def fail(self, error: Exception) -> None:
        self.steps.put(error)

    def is_cancelled(self) -> bool:
        return self.cancelled.is_set()


class LocalDecodePool:
    """The decode pool as one DecodeService (engine loop thread) in this process."""

    def __init__(self, service: DecodeService) -> None:
        self.service = service
        self._sinks: dict[str, _QueueSink] = {}
        self._lock = threading.Lock()

    def generate(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        handoff: Handoff | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[DecodeStep]:
        sink = _QueueSink()
        prefill = None
        if handoff is not None:
            prefill = prefill_result(
                request_id, handoff.first_token, handoff.seed, handoff.kv_payload.data
            )
        with self._lock:
            self._sinks[request_id] = sink
        try:
            self.service.submit(request_id, params, sink, prefill=prefill, prompt_ids=prompt_ids)
            while True:
                step = sink.steps.get()
                if isinstance(step, Exception):  # the engine died
                    raise PoolError(f"decode: {step}") from step
                yield step
                if step.finish_reason is not None:
                    return
        finally:
            with self._lock:
                self._sinks.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            sink = self._sinks.get(request_id)
        if sink is not None:
            sink.cancelled.set()
