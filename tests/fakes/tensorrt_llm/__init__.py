"""A test double of the few `tensorrt_llm` LLM-API calls disagg uses.

It stands for NVIDIA's TensorRT-LLM, which needs a GPU and cannot be installed here. It keeps
the contract that matters to disagg's adapters: a `context_only` request returns one token and
DisaggregatedParams; a `generation_only` request must present the same ctx_request_id,
opaque_state and prompt (else it fails, as a lost KV transfer would), starts its output with
the context's first token, and streams cumulative outputs. Tokens are a deterministic function
of the prompt, so a disaggregated run can be compared with a co-located one.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from tensorrt_llm.llmapi import DisaggregatedParams

__all__ = ["LLM", "SamplingParams", "DisaggregatedParams"]
VOCAB = 1000


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)


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


class LLM:
    instances: list[LLM] = []
    # what the cache transceiver would carry between executors: context id -> (prompt, state)
    contexts: dict[int, tuple[list[int], bytes]] = {}

    def __init__(self, model: str, **options) -> None:
        self.model, self.options = model, options
        self.calls: list[tuple[str, list[int], SamplingParams, DisaggregatedParams | None]] = []
        self._ids = itertools.count(1000)
        LLM.instances.append(self)

    def _tokens(self, prompt: list[int], n: int) -> list[int]:
        t = first_token(prompt)
        out = [t]
        while len(out) < n:
            t = next_token(t)
            out.append(t)
        return out

    def generate(self, prompt, sampling_params=None, disaggregated_params=None):
        sp = sampling_params or SamplingParams()
        self.calls.append(("generate", list(prompt), sp, disaggregated_params))
        tokens = self._tokens(list(prompt), sp.max_tokens)
        params = None
        if disaggregated_params is not None and disaggregated_params.request_type == "context_only":
            ctx = next(self._ids)
            state = bytes([ctx % 256, 0, 255]) + b"kv-at-" + str(ctx).encode()
            self.contexts[ctx] = (list(prompt), state)
            params = DisaggregatedParams(
                request_type="context_only",
                first_gen_tokens=[tokens[0]],
                ctx_request_id=ctx,
                opaque_state=state,
            )
            tokens = tokens[:1]
        return RequestOutput([CompletionOutput(tokens, "length", params)])

    def generate_async(
        self, prompt, sampling_params=None, disaggregated_params=None, streaming=False
    ):
        sp = sampling_params or SamplingParams()
        self.calls.append(("generate_async", list(prompt), sp, disaggregated_params))
        if disaggregated_params is not None:
            if disaggregated_params.request_type != "generation_only":
                raise ValueError("generate_async here takes generation_only requests")
            ctx = self.contexts.get(disaggregated_params.ctx_request_id)
            if ctx is None or ctx != (list(prompt), disaggregated_params.opaque_state):
                raise RuntimeError("KV cache transfer failed: unknown context or state")
            if disaggregated_params.first_gen_tokens != [first_token(list(prompt))]:
                raise RuntimeError("first_gen_tokens do not match the context")
        tokens = self._tokens(list(prompt), sp.max_tokens)
        return GenerationResult(tokens, sp.max_tokens, set(sp.stop_token_ids))
