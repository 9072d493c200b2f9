"""PrefillEngine / DecodeEngine roles played by TensorRT-LLM's LLM API.

    prefill:  llm.generate(prompt, SamplingParams(max_tokens=1),
                           disaggregated_params=DisaggregatedParams(request_type="context_only"))
              -> first token + DisaggregatedParams (ctx_request_id, opaque_state, ...)
    decode:   llm.generate_async(prompt, sampling, streaming=True,
                                 disaggregated_params=<those, request_type="generation_only">)
              -> tokens; the KV cache arrives through TensorRT-LLM's cache transceiver

TrtllmDecodeEngine keeps DecodeEngine's interface (add_request / finish_request / step /
has_unfinished / stats), so DecodeService and the decode model drive it unchanged: one thread
per request reads TensorRT-LLM's stream into a queue, and `step()` drains it.

Both pools reuse KV blocks across requests (prefix caching, kv_events.py): each engine reports
the prompt tokens a request found cached (num_reused_tokens) and its pool's KV cache events
(`kv_cache_events()`), for a router that sends a prompt where its prefix already is.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from disagg.contracts import DecodeStats
from disagg.engine.llm_engine import PrefillResult, TokenOutput, resolve_seed
from disagg.engine.sequence import FinishReason, SamplingParams, TokenLogprob
from disagg.errors import CapacityError, RequestCancelledError, RequestError
from disagg.trtllm.kv_events import KvCacheEvent, RequestFeatures, read_events
from disagg.trtllm.payload import TrtllmHandoff, params_to_dict
from disagg.trtllm.sampling import TrtllmApi, trt_logprob, trt_sampling

if TYPE_CHECKING:  # (tensorrt_llm has no types: Any to mypy, names to readers)
    import tensorrt_llm
    from tensorrt_llm.llmapi import RequestOutput

CANCEL_POLL_S = 0.02  # how often a running context request asks whether its client left
FINISH = {  # CompletionOutput.finish_reason (1.0: stop, length, timeout, cancelled)
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.ABORT,  # after result.abort()
    "timeout": FinishReason.ABORT,  # the request's own timeout, ended by the server
}


class TrtllmPrefillEngine:
    def __init__(
        self,
        llm: tensorrt_llm.LLM,
        api: TrtllmApi,
        max_prompt_tokens: int,
        features: RequestFeatures | None = None,
    ) -> None:
        self.llm = llm
        self.api = api
        self.max_prompt_tokens = max_prompt_tokens
        self.features = features or RequestFeatures.of(llm, api.SamplingParams, {})

    def kv_cache_events(self, timeout_s: float = 0.0) -> list[KvCacheEvent]:
        """Blocks this pool stored or evicted since the last call."""
        return read_events(self.llm, timeout_s)

    def prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        is_cancelled: Callable[[], bool] | None = None,
    ) -> tuple[PrefillResult, TrtllmHandoff]:
        if not prompt_ids:
            raise RequestError("empty prompt")
        if len(prompt_ids) > self.max_prompt_tokens:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens over {self.max_prompt_tokens}")
        seed = resolve_seed(params)
        salt = self.features.salt(request_id, params.cache_salt, params.use_cache)
        start = time.perf_counter()
        sampling = trt_sampling(
            self.api, params, seed, max_tokens=1, perf_metrics=self.features.perf_metrics,
            guided_backend=self.features.guided_backend,
        )  # fmt: skip
        out = self._context(prompt_ids, sampling, salt, is_cancelled or (lambda: False))
        completion = out.outputs[0]
        if not completion.token_ids or completion.disaggregated_params is None:
            raise RuntimeError("TensorRT-LLM returned no first token or no disaggregated params")
        handoff = TrtllmHandoff(
            list(prompt_ids),
            seed,
            params_to_dict(completion.disaggregated_params),
            salt.get("cache_salt", ""),
        )
        # kv None: the K/V moves through TensorRT-LLM's transceiver; `handoff` names it
        result = PrefillResult(
            request_id,
            int(completion.token_ids[0]),
            None,  # type: ignore[arg-type]  # (PrefillResult.kv types PyTorch's payload)
            seed,
            time.perf_counter() - start,
            num_reused_tokens=self.features.reused_tokens(out, len(prompt_ids)),
            first_logprob=self._first_logprob(completion, params),
        )
        return result, handoff

    @staticmethod
    def _first_logprob(completion: Any, params: SamplingParams) -> TokenLogprob | None:
        logprobs = getattr(completion, "logprobs", None)
        if params.logprobs is None or not logprobs:
            return None
        return trt_logprob(logprobs[0], int(completion.token_ids[0]), params.logprobs)

    def _context(
        self,
        prompt_ids: list[int],
        sampling: Any,
        salt: dict[str, str],
        is_cancelled: Callable[[], bool],
    ) -> RequestOutput:
        """The context request's output. It runs through generate_async, whose handle can be
        aborted (GenerationResult.abort -> executor.abort_request, TensorRT-LLM 1.0's
        executor/result.py): while it runs, `is_cancelled` is asked every CANCEL_POLL_S and a
        request whose client left is aborted, so its KV blocks are freed then rather than
        held for a generation half that will not come (RequestCancelledError)."""
        future = self.llm.generate_async(
            prompt_ids,
            sampling_params=sampling,
            disaggregated_params=self.api.DisaggregatedParams(request_type="context_only"),
            **salt,
        )
        while True:
            try:  # (result(timeout) raises queue.Empty while the request runs)
                return future.result(timeout=CANCEL_POLL_S)
            except queue.Empty:
                if is_cancelled():
                    future.abort()
                    raise RequestCancelledError(
                        "TensorRT-LLM context request aborted: the client went away"
                    ) from None


class TrtllmDecodeEngine:
    def __init__(
        self,
        llm: tensorrt_llm.LLM,
        api: TrtllmApi,
        max_num_seqs: int,
        features: RequestFeatures | None = None,
    ) -> None:
        self.llm = llm
        self.api = api
        self.max_num_seqs = max_num_seqs
        self.features = features or RequestFeatures.of(llm, api.SamplingParams, {})
        self._events: queue.Queue[TokenOutput] = queue.Queue()
        self._streams: dict[str, Any] = {}  # request id -> TensorRT-LLM result (abortable)
        self._lock = threading.Lock()

    @property
    def has_unfinished(self) -> bool:
        return bool(self._streams) or not self._events.empty()

    def stats(self) -> DecodeStats:
        return DecodeStats(num_running=len(self._streams), num_waiting=0)

    def kv_cache_events(self, timeout_s: float = 0.0) -> list[KvCacheEvent]:
        """Blocks this pool stored or evicted since the last call."""
        return read_events(self.llm, timeout_s)

    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        prefill: PrefillResult | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        with self._lock:
            if len(self._streams) >= self.max_num_seqs:
                raise CapacityError(f"decode is full ({self.max_num_seqs} sequences)")
            if prefill is not None:
                # prefill_result (pipeline/local.py) put the TrtllmHandoff there
                handoff: TrtllmHandoff = prefill.kv  # type: ignore[assignment]
                fields = {**handoff.params, "request_type": "generation_only"}
                # the context's salt, so both halves hash the prompt's blocks alike
                salt = {"cache_salt": handoff.cache_salt} if handoff.cache_salt else {}
                result = self.llm.generate_async(
                    handoff.prompt_ids,
                    sampling_params=trt_sampling(
                        self.api,
                        params,
                        handoff.seed,
                        guided_backend=self.features.guided_backend,
                    ),  # fmt: skip
                    disaggregated_params=self.api.DisaggregatedParams(**fields),
                    streaming=True,
                    **salt,
                )
                prompt_len = len(handoff.prompt_ids)
            else:  # co-located / fallback: TensorRT-LLM runs the whole request here
                if not prompt_ids:
                    raise RequestError("empty prompt")
                salt = self.features.salt(request_id, params.cache_salt, params.use_cache)
                result = self.llm.generate_async(
                    prompt_ids,
                    sampling_params=trt_sampling(
                        self.api,
                        params,
                        resolve_seed(params),
                        perf_metrics=self.features.perf_metrics,
                        guided_backend=self.features.guided_backend,
                    ),
                    streaming=True,
                    **salt,
                )
                prompt_len = len(prompt_ids)
            self._streams[request_id] = result
        # generation_only output starts with the context's first token, which the
        # orchestrator already has from prefill
        skip = 1 if prefill is not None else 0
        threading.Thread(
            target=self._pump,
            args=(request_id, result, skip, prompt_len, params.logprobs),
            name=f"trtllm-{request_id[:8]}",
            daemon=True,
        ).start()

    def _pump(
        self, request_id: str, result: RequestOutput, skip: int, prompt_len: int, k: int | None
    ) -> None:
        """Cumulative streaming outputs -> one TokenOutput per new token (output index i, the
        first `skip` left out; token 0 says how much of the prompt was cached), then the
        finish."""
        seen = 0  # tokens of the cumulative output already handled
        reason = FinishReason.ABORT
        try:
            for out in result:
                completion = out.outputs[0]
                tokens = completion.token_ids
                logprobs = getattr(completion, "logprobs", None) or []
                # aligned from the end: 1.0's generation_only list lacks the first token's
                offset = len(tokens) - len(logprobs)
                for i in range(max(seen, skip), len(tokens)):
                    reused = self.features.reused_tokens(out, prompt_len) if i == 0 else 0
                    lp = None
                    if k is not None and i >= offset:
                        lp = trt_logprob(logprobs[i - offset], int(tokens[i]), k)
                    event = TokenOutput(request_id, int(tokens[i]), i, None, reused, lp)
                    self._events.put(event)
                seen = len(tokens)
                if completion.finish_reason:
                    reason = FINISH.get(completion.finish_reason, FinishReason.STOP)
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            self._events.put(TokenOutput(request_id, None, seen, reason))

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        with self._lock:
            result = self._streams.get(request_id)
        if result is not None:
            result.abort()

    def step(self, wait_s: float = 0.05) -> list[TokenOutput]:
        """Whatever TensorRT-LLM produced since the last step (waits briefly for something)."""
        outputs = []
        try:
            outputs.append(self._events.get(timeout=wait_s))
            while True:
                outputs.append(self._events.get_nowait())
        except queue.Empty:
            pass
        return outputs
