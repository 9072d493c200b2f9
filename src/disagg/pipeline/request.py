"""A generate request as the orchestrator receives it, and the one object that owns its state
while it is served (`RequestRun`), as nano-vllm's `Sequence` owns a sequence: the
orchestrator's steps take the run, never a request's pieces as separate arguments."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.codec.generate import EXCLUDE_INPUT_DEFAULT
from disagg.contracts import Handoff, Reply
from disagg.engine.sequence import SamplingParams
from disagg.engine.tokenizer import TextStream


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str  # echoed before the reply when exclude_input_in_output is false
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = EXCLUDE_INPUT_DEFAULT  # one default, the codec's
    arrival_s: float = field(default_factory=time.perf_counter)  # TTFT and e2e count from here


@dataclass(eq=False)
class RequestRun:
    """One request while the orchestrator serves it: what the client asked, what has been
    produced, and where it was served. Written only by the orchestrator's thread for it."""

    request: GenerateRequest  # as the client sent it
    text: TextStream  # token ids -> whole-character deltas, stop strings
    emit: Callable[[Reply], None]  # streamed deltas go here
    is_cancelled: Callable[[], bool]
    # what the decode replica serving it now was asked: after a migration, a child request
    # whose prompt carries the tokens already produced
    current: GenerateRequest = field(init=False)
    handoff: Handoff | None = None  # the prefill pool's output; None: decode prefills itself
    served_by: str = ""  # COLOCATED, DISAGGREGATED or FALLBACK
    prefill_pid: int = 0
    decode_pid: int = 0  # set by decode's first response (its acknowledgement)
    token_ids: list[int] = field(default_factory=list)  # every output token so far
    kv_bytes: int = 0  # size of the KV payload handed from prefill to decode
    kv_handoff_s: float = 0.0  # moving it: serialise + transfer + verify + import
    last_token_s: float | None = None  # perf_counter() of the latest token; None before TTFT
    num_cached_tokens: int = 0  # prompt tokens a prefix cache gave (prefill's or decode's)

    def __post_init__(self) -> None:
        self.current = self.request

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_input_tokens(self) -> int:
        return len(self.request.prompt_ids)

    def delta(self, text: str) -> Reply:
        """A streamed response carrying `text`."""
        return Reply(text, self.num_input_tokens, self.num_output_tokens)

    def final_reply(self, finish_reason: str) -> Reply:
        """The last response: the rest of the text while streaming, else the whole reply
        (the prompt before it unless exclude_input_in_output)."""
        req = self.request
        tail = self.text.flush()
        if req.stream:
            text = tail
        elif req.exclude_input_in_output:
            text = self.text.text
        else:
            text = req.prompt_text + self.text.text
        return Reply(
            text,
            self.num_input_tokens,
            self.num_output_tokens,
            finish_reason=finish_reason,
            served_by=self.served_by,
            prefill_pid=self.prefill_pid,
            decode_pid=self.decode_pid,
            token_ids=list(self.token_ids),
            kv_bytes=self.kv_bytes,
            kv_handoff_s=self.kv_handoff_s,
            num_cached_tokens=self.num_cached_tokens,
        )
