"""A generate request as the orchestrator receives it (`build_request` makes one from the
client's fields), and the one object that owns its state while it is served (`RequestRun`),
as nano-vllm's `Sequence` owns a sequence: the orchestrator's steps take the run, never a
request's pieces as separate arguments."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disagg import contracts as C
from disagg.codec.fields import EXCLUDE_INPUT_DEFAULT, GenerationFields
from disagg.contracts import Handoff, Reply
from disagg.engine.sequence import FinishReason, SamplingParams, TokenLogprob
from disagg.engine.tokenizer import TextStream, Tokenizer
from disagg.errors import RequestError
from disagg.pipeline.handoff import release


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str  # echoed before the reply when exclude_input_in_output is false
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = EXCLUDE_INPUT_DEFAULT  # one default, the codec's
    arrival_s: float = field(default_factory=time.perf_counter)  # TTFT and e2e count from here


def build_request(
    fields: dict[str, Any],
    tokenizer: Tokenizer,
    max_tokens_default: int,
    caller_id: str = "",
) -> GenerateRequest:
    """Client-facing fields (TensorRT-LLM ensemble names, already plain Python values: codec
    OrchestratorRequest.decode) -> a validated-shape GenerateRequest. Semantic limits are
    checked by `check_request`."""
    prompt_ids = [int(t) for t in fields.get(C.INPUT_IDS, [])]
    g = GenerationFields.parse(fields)  # as the router reads them (routing/request.py)
    for name, value in (
        (C.MAX_TOKENS, g.max_tokens),
        (C.TOP_K, g.top_k),
        (C.END_ID, g.end_id),
        (C.PAD_ID, g.pad_id),
        (C.MIN_LENGTH, g.min_length),
    ):
        if value is not None and value < 0:
            # Triton's HTTP endpoint stores a JSON number above 2**31-1 into the INT32 tensor
            # modulo 2**32: 3e9 arrives as -1294967296; say so rather than echo that number
            raise RequestError(
                f"{name} must not be negative, got {value} (if you sent a number "
                "above 2147483647, Triton's INT32 input wrapped it around)"
            )
    params = SamplingParams(
        max_tokens=max_tokens_default if g.max_tokens is None else g.max_tokens,
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        seed=g.seed,
        stop_token_ids=(() if g.end_id is None else (g.end_id,)) + g.stop_token_ids,
        stop=g.stop_words,
        bad_words_ids=tuple(tuple(tokenizer.encode(w)) for w in g.bad_words),
        ignore_eos=g.ignore_eos,
        cache_salt=g.cache_salt,
        use_cache=g.use_prefix_cache,
        presence_penalty=g.presence_penalty,
        frequency_penalty=g.frequency_penalty,
        repetition_penalty=g.repetition_penalty,
        logit_bias=g.logit_bias,
        guide_type=g.guide_type,
        guide=g.guide,
        min_tokens=g.min_length,
        logprobs=g.logprobs,
    )
    return GenerateRequest(
        request_id=C.child_request_id(caller_id),
        prompt_ids=prompt_ids,
        prompt_text=g.text_input,
        params=params,
        stream=g.stream,
        exclude_input_in_output=g.exclude_input_in_output,
    )


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
    kv_bytes: int = 0  # hand-off bytes that passed here (a reference where the payload did not)
    kv_handoff_s: float = 0.0  # moving it: serialise + transfer + verify + import
    last_token_s: float | None = None  # perf_counter() of the latest token; None before TTFT
    num_cached_tokens: int = 0  # prompt tokens a prefix cache gave (prefill's or decode's)
    decode_beside: int = 0  # sequences this orchestrator had decoding when it was sent
    # when the request asks for logprobs: OpenAI's object for every token of the text so far,
    # and how many of them streamed deltas have carried
    logprobs: list[dict[str, Any]] | None = None
    logprobs_sent: int = 0

    def __post_init__(self) -> None:
        self.current = self.request
        if self.request.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_input_tokens(self) -> int:
        return len(self.request.prompt_ids)

    def delta(self, text: str) -> Reply:
        """A streamed response carrying `text` (and the logprobs not sent yet)."""
        return Reply(text, self.num_input_tokens, self.num_output_tokens, logprobs=self._unsent())

    def _unsent(self) -> list[dict[str, Any]] | None:
        if self.logprobs is None:
            return None
        out = self.logprobs[self.logprobs_sent :]
        self.logprobs_sent = len(self.logprobs)
        return out

    @property
    def has_unsent(self) -> bool:
        return self.logprobs is not None and self.logprobs_sent < len(self.logprobs)

    def abandon(self) -> Reply:
        """The client left before decode began: the hand-off is freed now (handoff.release)
        and the request ends as aborted, with nothing sent to decode."""
        self.release_unclaimed()
        self.handoff = None
        return self.final_reply(FinishReason.ABORT.value)

    def release_unclaimed(self) -> None:
        """Free a hand-off decode never acknowledged (the client left, or sending the first
        token or reaching decode failed, between prefill's reply and decode's pull): a lease
        on a prefill server would otherwise wait for its TTL. Decode acknowledges only after
        taking the payload, so an acknowledged one is gone already."""
        if self.handoff is not None and not self.decode_pid:
            release(self.handoff.kv_payload)

    def final_reply(self, finish_reason: str) -> Reply:
        """The last response: the rest of the text while streaming, else the whole reply
        (the prompt before it unless exclude_input_in_output)."""
        req = self.request
        tail = self.text.flush()
        logprobs = self._unsent() if req.stream else self.logprobs
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
            logprobs=logprobs,
        )


# what OpenAI answers for a token of (near) zero probability: JSON has no -inf
MIN_LOGPROB = -9999.0


def logprob_object(tokenizer: Tokenizer, token_id: int, lp: TokenLogprob) -> dict[str, Any]:
    """One output token's log-probabilities as OpenAI's chat completions give them."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token)
        value = max(logprob, MIN_LOGPROB) if math.isfinite(logprob) else MIN_LOGPROB
        return {"token": raw.decode("utf-8", "replace"), "logprob": value, "bytes": list(raw)}

    top = [entry(t, v) for t, v in lp.top]
    return {**entry(token_id, lp.logprob), "top_logprobs": top}
