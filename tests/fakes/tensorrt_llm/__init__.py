"""A test double of the few `tensorrt_llm` LLM-API calls disagg uses.

It stands for NVIDIA's TensorRT-LLM, which needs a GPU and cannot be installed here. It keeps
the contract that matters to disagg's adapters: a `context_only` request returns one token and
DisaggregatedParams; a `generation_only` request must present the same ctx_request_id,
opaque_state and prompt (else it fails, as a lost KV transfer would), starts its output with
the context's first token, and streams cumulative outputs. Tokens are a deterministic function
of the prompt, so a disaggregated run can be compared with a co-located one.

And it refuses what the real library refuses (TensorRT-LLM 1.0, checked against its source):
`LLM(**options)` with a key outside the LLM-API argument set or a transceiver backend of the
wrong case (llmapi/llm_args.py), SamplingParams with an unknown field (a kw-only dataclass
upstream too), and a prompt longer than max_num_tokens that is not generation-only, unless
chunked prefill is on (llmapi/llm.py, _check_arguments).
"""

from __future__ import annotations

import itertools
import threading
import time
import typing
from dataclasses import dataclass

from tensorrt_llm.llmapi import DisaggregatedParams, llm_args

__all__ = ["LLM", "SamplingParams", "DisaggregatedParams"]
__version__ = "1.0.0"
VOCAB = 1000


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
    ignore_eos: bool = False
    detokenize: bool = True

    @property
    def _greedy_decoding(self) -> bool:  # upstream 1.0's rule: temperature does not count
        return (self.top_k is None or self.top_k == 1) and (self.top_p is None or self.top_p == 0)


@dataclass
class CompletionOutput:
    token_ids: list[int]
    finish_reason: str | None = None
    disaggregated_params: DisaggregatedParams | None = None


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]


def next_token(prev: int) -> int:
    return (prev * 7 + 3) % VOCAB


def first_token(prompt: list[int]) -> int:
    return sum(prompt) % VOCAB


class GenerationResult:
    def __init__(self, tokens: list[int], max_tokens: int, stop: set[int]) -> None:
        self.tokens, self.max_tokens, self.stop = tokens, max_tokens, stop
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()

    def __iter__(self):
        out: list[int] = []
        for t in self.tokens:
            if self.aborted.is_set():
                yield RequestOutput([CompletionOutput(list(out), "cancelled")])
                return
            out.append(t)
            if t in self.stop:
                yield RequestOutput([CompletionOutput(list(out), "stop")])
                return
            done = len(out) >= self.max_tokens
            time.sleep(0.002)  # a token takes a while, as on a GPU
            yield RequestOutput([CompletionOutput(list(out), "length" if done else None)])
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
    backend = (options.get("cache_transceiver_config") or {}).get("backend")
    annotation = llm_args.CacheTransceiverConfig.model_fields["backend"].annotation
    literal = next(a for a in typing.get_args(annotation) if a is not type(None))
    if backend is not None and backend not in typing.get_args(literal):
        raise ValueError(f"cache_transceiver_config.backend: input should be {literal}")


class LLM:
    instances: list[LLM] = []
    # what the cache transceiver would carry between executors: context id -> (prompt, state)
    contexts: dict[int, tuple[list[int], bytes]] = {}

    def __init__(self, model: str, **options) -> None:
        _check_options(options)
        self.model, self.options = model, options
        self.calls: list[tuple[str, list[int], SamplingParams, DisaggregatedParams | None]] = []
        self._ids = itertools.count(1000)
        LLM.instances.append(self)

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
        tokens = self._tokens(list(inputs), sp.max_tokens)
        params = None
        if disaggregated_params is not None and disaggregated_params.request_type == "context_only":
            ctx = next(self._ids)
            state = bytes([ctx % 256, 0, 255]) + b"kv-at-" + str(ctx).encode()
            self.contexts[ctx] = (list(inputs), state)
            params = DisaggregatedParams(
                request_type="context_only",
                first_gen_tokens=[tokens[0]],
                ctx_request_id=ctx,
                opaque_state=state,
            )
            tokens = tokens[:1]
        return RequestOutput([CompletionOutput(tokens, "length", params)])

    def generate_async(
        self, inputs, sampling_params=None, streaming=False, disaggregated_params=None
    ):
        sp = sampling_params or SamplingParams()
        self._check_arguments(list(inputs), disaggregated_params)
        self.calls.append(("generate_async", list(inputs), sp, disaggregated_params))
        if disaggregated_params is not None:
            if disaggregated_params.request_type != "generation_only":
                raise ValueError("generate_async here takes generation_only requests")
            ctx = self.contexts.get(disaggregated_params.ctx_request_id)
            if ctx is None or ctx != (list(inputs), disaggregated_params.opaque_state):
                raise RuntimeError("KV cache transfer failed: unknown context or state")
            if disaggregated_params.first_gen_tokens != [first_token(list(inputs))]:
                raise RuntimeError("first_gen_tokens do not match the context")
        tokens = self._tokens(list(inputs), sp.max_tokens)
        return GenerationResult(tokens, sp.max_tokens, set(sp.stop_token_ids or ()))
