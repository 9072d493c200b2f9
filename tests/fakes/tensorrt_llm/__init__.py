"""A test double of the few `tensorrt_llm` LLM-API calls disagg uses.

It stands for NVIDIA's TensorRT-LLM, which needs a GPU and cannot be installed here. It keeps
the contract that matters to disagg's adapters: a `context_only` request returns one token and
DisaggregatedParams; a `generation_only` request must present the same ctx_request_id,
opaque_state and prompt (else it fails, as a lost KV transfer would), starts its output with
the context's first token, and streams cumulative outputs. Tokens are a deterministic function
of the prompt, so a disaggregated run can be compared with a co-located one.

And it refuses what the real library refuses (TensorRT-LLM 1.0, checked against its source):
`LLM(**options)` with a key outside the LLM-API argument set, a nested config field that is
not one, or a transceiver backend of the wrong case (llmapi/llm_args.py); SamplingParams
with an unknown field (a kw-only dataclass upstream too); a generate keyword 1.0 lacks
(`cache_salt`); and a prompt longer than max_num_tokens that is not generation-only, unless
chunked prefill is on (llmapi/llm.py, _check_arguments). A `quant_config` option is refused
(TorchLlmArgs has none: 1.0's PyTorch backend loads weights as the checkpoint stores them), a
KV cache dtype other than auto / fp8 / nvfp4 too, and a checkpoint directory whose
quantization the PyTorch path cannot load or whose KV cache algorithm conflicts with
`kv_cache_config.dtype` (upstream llmapi/llm_utils.py; here llmapi/llm_utils.py too).

It fails the way the real one fails where disagg must cope: a context whose generation half
never comes keeps its KV blocks held (`held_contexts`) until the transfer ends; an abort of
the finished context request does not free them (1.0's pyexecutor); only a
`cache_transceiver_config.kv_transfer_timeout_ms` does, on versions that have the field
(tests switch it on in llm_args). KV block reuse keeps whole 32-token prompt blocks, LRU,
bounded by `kv_cache_config.max_tokens`, and reports them as KV cache events shaped like
_utils.py's KVCacheEventSerializer output.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import typing
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

from tensorrt_llm.llmapi import DisaggregatedParams, GuidedDecodingParams, llm_args
from tensorrt_llm.llmapi.llm_utils import update_from_hf_quant_config

__all__ = ["LLM", "SamplingParams", "DisaggregatedParams"]
__version__ = "1.0.0"
VOCAB = 1000
TOKENS_PER_BLOCK = 32


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """The fields disagg may set, with upstream's names and None defaults."""

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    return_perf_metrics: bool = False  # "keep in sync with tllme.OutputConfig" upstream
    guided_decoding: GuidedDecodingParams | None = None
    logprobs: int | None = None  # top logprobs per output token (1.0's sampling_params.py)

    @property
    def _greedy_decoding(self) -> bool:  # upstream 1.0's rule: temperature does not count
        return (self.top_k is None or self.top_k == 1) and (self.top_p is None or self.top_p == 0)


@dataclass
class CompletionOutput:
    token_ids: list[int]
    finish_reason: str | None = None
    disaggregated_params: DisaggregatedParams | None = None
    request_perf_metrics: object | None = None  # with SamplingParams.return_perf_metrics
    # with SamplingParams.logprobs: one {token id: Logprob} per output token (1.0's
    # executor/result.py TokenLogprobs), the top ones and the sampled token
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class Logprob:
    """1.0's executor/result.py Logprob."""

    logprob: float
    rank: int | None = None


def token_logprobs(token: int, k: int) -> dict[int, Logprob]:
    """The fake's distribution at a token: the sampled token first (rank 1), then k - 1
    others. The real TRT backend adds the sampled token when it is not in the top k."""
    out = {token: Logprob(-0.25, 1)}
    for r in range(2, k + 1):
        out[(token + r * 11) % VOCAB] = Logprob(-0.25 - r, r)
    return out


def with_logprobs(out: CompletionOutput, sp: SamplingParams, generation_only: bool = False):
    """What 1.0 returns with logprobs asked for: a generation_only request's list lacks the
    context's first token (its logprob stayed on the context server until TensorRT-LLM
    PR #11727, after 1.0)."""
    if sp.logprobs:
        tokens = out.token_ids[1:] if generation_only else out.token_ids
        out.logprobs = [token_logprobs(t, sp.logprobs) for t in tokens]
    return out


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]

    def abort(self) -> None:
        """A finished request: nothing to abort (a held context stays held)."""


def next_token(prev: int) -> int:
    return (prev * 7 + 3) % VOCAB


def first_token(prompt: list[int]) -> int:
    return sum(prompt) % VOCAB


def perf_metrics(num_reused_blocks: int) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_metrics=SimpleNamespace(num_reused_blocks=num_reused_blocks))


class GenerationResult:
    def __init__(
        self, tokens: list[int], sp: SamplingParams, reused_blocks: int, generation_only=False
    ) -> None:
        self.tokens, self.max_tokens = tokens, sp.max_tokens
        self.sp, self.generation_only = sp, generation_only
        self.stop = set(sp.stop_token_ids or ())
        self.metrics = perf_metrics(reused_blocks) if sp.return_perf_metrics else None
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()

    def _out(self, tokens: list[int], reason: str | None) -> RequestOutput:
        out = CompletionOutput(list(tokens), reason, None, self.metrics)
        return RequestOutput([with_logprobs(out, self.sp, self.generation_only)])

    def __iter__(self):
        out: list[int] = []
        for t in self.tokens:
            if self.aborted.is_set():
                yield self._out(out, "cancelled")
                return
            out.append(t)
            if t in self.stop:
                yield self._out(out, "stop")
                return
            done = len(out) >= self.max_tokens
            time.sleep(0.002)  # a token takes a while, as on a GPU
            yield self._out(out, "length" if done else None)
            if done:
                return


def _check_options(options: dict) -> None:
    unknown = set(options) - llm_args.TORCH_FIELDS
    if unknown:
        raise ValueError(f"Extra inputs are not permitted: {sorted(unknown)}")
    for key, allowed in (
        ("kv_cache_config", llm_args.KV_CACHE_FIELDS),
        ("cache_transceiver_config", llm_args.TRANSCEIVER_FIELDS),
    ):
        extra = set(options.get(key) or {}) - allowed
        if extra:
            raise ValueError(f"{key}: extra inputs are not permitted: {sorted(extra)}")
    kv = options.get("kv_cache_config") or {}
    typed = (("enable_block_reuse", bool), ("event_buffer_max_size", int), ("dtype", str))
    for name, kind in typed:
        if name in kv and not isinstance(kv[name], kind):
            raise ValueError(f"kv_cache_config.{name}: input should be a valid {kind.__name__}")
    if kv.get("dtype", "auto") not in llm_args.KV_CACHE_DTYPES:  # at model load upstream
        raise ValueError(
            f'Overriding KV cache quantization with an invalid type "{kv["dtype"]}". '
            f"Accepted types are {llm_args.KV_CACHE_DTYPES}."
        )
    backend = (options.get("cache_transceiver_config") or {}).get("backend")
    annotation = llm_args.CacheTransceiverConfig.model_fields["backend"].annotation
    literal = next(a for a in typing.get_args(annotation) if a is not type(None))
    if backend is not None and backend not in typing.get_args(literal):
        raise ValueError(f"cache_transceiver_config.backend: input should be {literal}")


@dataclass
class _Context:
    """A finished context request whose KV waits for its generation half."""

    prompt: list[int]
    state: bytes
    owner: LLM
    created: float


class ContextResult:
    """A context_only request from generate_async: done `LLM.context_s` after it was sent.
    result(timeout) raises queue.Empty until then, as GenerationResult.result does (its
    queue.get(timeout=...)); abort() before then ends it with no KV held for a generation
    half (1.0: executor.abort_request, the request's blocks freed); after, it frees nothing."""

    def __init__(self, owner: LLM, prompt: list[int], sp: SamplingParams) -> None:
        self.owner, self.prompt, self.sp = owner, prompt, sp
        self.done_at = time.monotonic() + owner.context_s
        self._aborted = False
        self._output: RequestOutput | None = None

    def abort(self) -> None:
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def result(self, timeout: float | None = None) -> RequestOutput:
        if self._output is not None:
            return self._output
        wait = self.done_at - time.monotonic()
        if timeout is not None and wait > timeout:
            time.sleep(timeout)
            raise queue.Empty
        time.sleep(max(wait, 0.0))
        if self._aborted:
            out = CompletionOutput([], "cancelled", None, None)
            self._output = RequestOutput([out])
        else:
            self._output = self.owner._context_output(self.prompt, self.sp)
        return self._output


class LLM:
    instances: list[LLM] = []
    context_s = 0.0  # how long a context request takes (generate_async)
    # what the cache transceiver would carry between executors: context id -> its KV
    contexts: dict[int, _Context] = {}

    def __init__(self, model: str, **options) -> None:
        _check_options(options)
        kv_dtype = (options.get("kv_cache_config") or {}).get("dtype", "auto")
        update_from_hf_quant_config(model, kv_dtype)  # before the weights, as upstream
        self.model, self.options = model, options
        self.calls: list[tuple[str, list[int], SamplingParams, DisaggregatedParams | None]] = []
        self._ids = itertools.count(1000 + 1000 * len(LLM.instances))
        kv = options.get("kv_cache_config") or {}
        self._reuse = kv.get("enable_block_reuse", True)  # 1.0's default: on
        self._event_buffer = kv.get("event_buffer_max_size", 0)
        limit = kv.get("max_tokens")
        self._max_blocks = limit // TOKENS_PER_BLOCK if limit else None
        self._blocks: OrderedDict[int, None] = OrderedDict()  # reusable, oldest first
        self._events: list[dict] = []
        self._event_ids = itertools.count()
        self._emit({"type": "created", "num_blocks_per_cache_level": [self._max_blocks or 0, 0]})
        LLM.instances.append(self)

    # ---------------------------------------------------------------- KV block reuse
    def _emit(self, data: dict) -> None:
        if self._reuse and self._event_buffer > 0:
            self._events.append({"event_id": next(self._event_ids), "data": data})
            del self._events[: -self._event_buffer]

    def _store_prompt(self, prompt: list[int]) -> int:
        """Keep the prompt's whole blocks for reuse: how many were already kept."""
        if not self._reuse:
            return 0
        reused, parent, new, first_parent = 0, None, [], None
        for end in range(TOKENS_PER_BLOCK, len(prompt) + 1, TOKENS_PER_BLOCK):
            block = prompt[end - TOKENS_PER_BLOCK : end]
            h = hash((parent, tuple(block)))
            if not new and h in self._blocks:
                reused, first_parent = reused + 1, h
                self._blocks.move_to_end(h)
            else:
                new.append((h, block))
            parent = h
        if new:
            for h, _ in new:
                self._blocks[h] = None
            blocks = [{"type": "stored_block", "block_hash": h, "tokens": t} for h, t in new]
            self._emit({"type": "stored", "parent_hash": first_parent, "blocks": blocks})
        while self._max_blocks is not None and len(self._blocks) > self._max_blocks:
            gone, _ = self._blocks.popitem(last=False)
            self._emit({"type": "removed", "block_hashes": [gone]})
        return reused

    def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict]:
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------- disaggregation
    def _transfer_timeout_s(self) -> float | None:
        ms = (self.options.get("cache_transceiver_config") or {}).get("kv_transfer_timeout_ms")
        return ms / 1000 if ms else None

    def held_contexts(self) -> int:
        """Contexts of this executor whose KV blocks are still held for a transfer."""
        LLM._expire()
        return sum(1 for c in LLM.contexts.values() if c.owner is self)

    @classmethod
    def _expire(cls) -> None:
        now = time.monotonic()
        for ctx, c in list(cls.contexts.items()):
            timeout = c.owner._transfer_timeout_s()
            if timeout is not None and now - c.created > timeout:
                del cls.contexts[ctx]

    def _check_arguments(self, prompt: list[int], params: DisaggregatedParams | None) -> None:
        gen_only = params is not None and params.request_type == "generation_only"
        limit = self.options.get("max_num_tokens")
        if (
            limit
            and not gen_only
            and not self.options.get("enable_chunked_prefill")
            and len(prompt) > limit
        ):
            raise ValueError(
                f"The sum of prompt length ({len(prompt)}), query length (0) should not exceed "
                f"max_num_tokens ({limit})"
            )

    def _tokens(self, prompt: list[int], n: int) -> list[int]:
        t = first_token(prompt)
        out = [t]
        while len(out) < n:
            t = next_token(t)
            out.append(t)
        return out

    def generate(self, inputs, sampling_params=None, use_tqdm=True, disaggregated_params=None):
        sp = sampling_params or SamplingParams()
        self._check_arguments(list(inputs), disaggregated_params)
        self.calls.append(("generate", list(inputs), sp, disaggregated_params))
        self.last_use_tqdm = use_tqdm
        if disaggregated_params is not None and disaggregated_params.request_type == "context_only":
            return self._context_output(list(inputs), sp)
        reused = self._store_prompt(list(inputs))
        tokens = self._tokens(list(inputs), sp.max_tokens)
        metrics = perf_metrics(reused) if sp.return_perf_metrics else None
        return RequestOutput([CompletionOutput(tokens, "length", None, metrics)])

    def _context_output(self, inputs: list[int], sp: SamplingParams) -> RequestOutput:
        """A finished context request: one token, its KV held for the generation half."""
        reused = self._store_prompt(list(inputs))
        tokens = self._tokens(list(inputs), sp.max_tokens)
        ctx = next(self._ids)
        state = bytes([ctx % 256, 0, 255]) + b"kv-at-" + str(ctx).encode()
        self.contexts[ctx] = _Context(list(inputs), state, self, time.monotonic())
        params = DisaggregatedParams(
            request_type="context_only",
            first_gen_tokens=[tokens[0]],
            ctx_request_id=ctx,
            opaque_state=state,
        )
        tokens = tokens[:1]
        metrics = perf_metrics(reused) if sp.return_perf_metrics else None
        return RequestOutput(
            [with_logprobs(CompletionOutput(tokens, "length", params, metrics), sp)]
        )

    def generate_async(
        self, inputs, sampling_params=None, streaming=False, disaggregated_params=None
    ):
        sp = sampling_params or SamplingParams()
        self._check_arguments(list(inputs), disaggregated_params)
        self.calls.append(("generate_async", list(inputs), sp, disaggregated_params))
        if disaggregated_params is not None and disaggregated_params.request_type == "context_only":
            if streaming:
                raise ValueError("a context_only request streams nothing here")
            return ContextResult(self, list(inputs), sp)
        if disaggregated_params is not None:
            if disaggregated_params.request_type != "generation_only":
                raise ValueError("generate_async takes context_only or generation_only requests")
            LLM._expire()
            ctx = self.contexts.get(disaggregated_params.ctx_request_id)
            if ctx is None or (ctx.prompt, ctx.state) != (
                list(inputs),
                disaggregated_params.opaque_state,
            ):
                raise RuntimeError("KV cache transfer failed: unknown context or state")
            if disaggregated_params.first_gen_tokens != [first_token(list(inputs))]:
                raise RuntimeError("first_gen_tokens do not match the context")
            del self.contexts[disaggregated_params.ctx_request_id]  # transferred: freed there
        reused = self._store_prompt(list(inputs)) if disaggregated_params is None else 0
        tokens = self._tokens(list(inputs), sp.max_tokens)
        return GenerationResult(tokens, sp, reused, disaggregated_params is not None)
