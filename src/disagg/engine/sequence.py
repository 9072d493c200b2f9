"""Request-side contracts: sampling parameters and the life of one sequence in decode."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from disagg.errors import RequestError

if TYPE_CHECKING:
    from disagg.engine.config import EngineConfig, ModelArgs
    from disagg.engine.grammar import Guide
    from disagg.engine.kv_payload import KVPayload

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
MAX_CACHE_SALT = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_REPETITION_PENALTY = 100.0
# guided decoding (engine/grammar.py): guide types are TensorRT-LLM's
# (`guided_decoding_guide_type`) plus "lark", llguidance's own syntax
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "lark")
MAX_GUIDE_CHARS = 64 * 1024
MAX_GUIDE_TOKENS = 1 << 20
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit, vLLM's default)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the server
    GRAMMAR = "grammar_error"  # the request's grammar allowed no next token (a dead end)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None  # None: a random seed is drawn per request
    stop_token_ids: tuple[int, ...] = ()  # finish on these, besides the model's EOS
    stop: tuple[str, ...] = ()  # finish when the text contains one; it is not returned
    ignore_eos: bool = False
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never to complete
    # Penalties (sampling.adjust_logits applies them, in vLLM's order). presence/frequency are
    # OpenAI's and count the output only: a token's logit loses presence_penalty once it
    # has been produced and frequency_penalty per time. repetition_penalty is vLLM's / HF's
    # and counts prompt and output: a positive logit is divided by it, a negative multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    # Not sampling, but carried with it to every pool: the prefix cache's namespace (the
    # gateway gives each API key its own, so no key sees another's prompts by timing) and
    # whether this request may use the cache at all
    cache_salt: str = ""
    use_cache: bool = True
    # Guided decoding (engine/grammar.py): the output must match the guide. guide_tokens:
    # tokens the grammar consumed before this request's own output (what a migrated stream
    # already sent; its new prompt ends with them)
    guide_type: str = ""  # "": none; else one of GUIDE_TYPES
    guide: str = ""
    guide_tokens: tuple[int, ...] = ()
    # Not sampling either: each output token's log-probability goes out with it, and this
    # many most likely alternatives (None: none of it; 0: the token's own alone)
    logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling changes this request's logits before choosing (a plain greedy
        row is one argmax over the batch)."""
        return bool(
            self.bad_words_ids
            or self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int, max_tokens_limit: int) -> None:
        """Raise RequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= max_tokens_limit:
            raise RequestError(
                f"max_tokens must be in [1, {max_tokens_limit}], got {self.max_tokens!r}"
            )
        if not (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and 0.0 <= self.temperature <= 100.0
        ):
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise RequestError(f"seed must be an integer in [0, 2**63-1], got {self.seed!r}")
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise RequestError(f"end_id (stop_token_ids) must be a token id in [0, {vocab_size})")
        if len(self.stop) > MAX_STOP_STRINGS or any(
            not isinstance(s, str) or not s for s in self.stop
        ):
            raise RequestError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT:
            raise RequestError(
                f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters"
            )
        if not isinstance(self.use_cache, bool):
            raise RequestError(f"use_cache must be a boolean, got {self.use_cache!r}")
        self._validate_penalties(vocab_size)
        self._validate_guide(vocab_size)
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise RequestError(
                f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if len(self.bad_words_ids) > MAX_STOP_STRINGS or any(
            not w or any(not isinstance(t, int) or not 0 <= t < vocab_size for t in w)
            for w in self.bad_words_ids
        ):
            raise RequestError(
                f"bad_words must be at most {MAX_STOP_STRINGS} non-empty token sequences"
            )

    def _validate_penalties(self, vocab_size: int) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(value := getattr(self, name), -2.0, 2.0):
                raise RequestError(f"{name} must be a number in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if not _is_number(r, 0.0, MAX_REPETITION_PENALTY) or r == 0:
            raise RequestError(
                f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] "
                f"(1: off), got {r!r}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(
            not isinstance(t, int) or not 0 <= t < vocab_size or not _is_number(b, -100, 100)
            for t, b in self.logit_bias
        ):
            raise RequestError(
                f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids in [0, {vocab_size}) "
                "to numbers in [-100, 100]"
            )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )

    def _validate_guide(self, vocab_size: int) -> None:
        """The request-level checks; whether the guide compiles is the engine's (it needs
        the tokenizer: engine/grammar.py)."""
        if not self.guide_type:
            if self.guide:
                raise RequestError("guided_decoding_guide needs guided_decoding_guide_type")
            return
        if self.guide_type not in GUIDE_TYPES:
            raise RequestError(
                f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}, "
                f"got {self.guide_type!r}"
            )
        if not isinstance(self.guide, str) or len(self.guide) > MAX_GUIDE_CHARS:
            raise RequestError(
                f"guided_decoding_guide must be a string of at most {MAX_GUIDE_CHARS} characters"
            )
        if self.guide_type != "json" and not self.guide:
            raise RequestError(
                f"guided_decoding_guide is required with guide type {self.guide_type}"
            )
        if len(self.guide_tokens) > MAX_GUIDE_TOKENS or any(
            not isinstance(t, int) or not 0 <= t < vocab_size for t in self.guide_tokens
        ):
            raise RequestError(f"guide_tokens must be token ids in [0, {vocab_size})")


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability, and the `top` most likely tokens at its position
    (token id, log-probability), best first. Both from the model's own distribution, before
    penalties, logit_bias, the grammar's mask or temperature change it (vLLM's default,
    `raw_logprobs`): what the model thinks, not what the sampler drew from."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_json(self) -> list[object]:
        return [self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_json(cls, data: object) -> TokenLogprob:
        """Raises ValueError / TypeError on anything but to_json's shape."""
        if not isinstance(data, list) or len(data) != 2:
            raise ValueError("a token logprob is [logprob, [[id, logprob], ...]]")
        lp, top = data
        return cls(float(lp), tuple((int(t), float(v)) for t, v in top))


def _is_number(value: object, lo: float, hi: float) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and lo <= value <= hi
    )


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for a decode slot
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request inside a decode engine.

    The newest token is not yet in the KV cache: the next decode step feeds it at
    position `num_cached_tokens` and samples the token after it."""

    request_id: str
    prompt_len: int
    output_ids: list[int]  # sampled so far; starts with prefill's first token
    params: SamplingParams
    seed: int  # effective seed (params.seed, or one drawn at admission)
    eos_token_ids: frozenset[int] = frozenset()
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int = -1  # decode slot while RUNNING
    finish_reason: FinishReason | None = None
    # prefill output waiting to be written into the slot when the sequence is admitted
    pending_kv: KVPayload | None = field(default=None, repr=False)
    arrival_s: float = field(default_factory=time.perf_counter)  # added to the engine
    # chunked prefill by decode itself: prompt positions already in the slot's KV cache
    # (None: the sequence came with its KV cache, or was prefilled whole)
    prefill_pos: int | None = None
    admitted_s: float = 0.0
    # the prompt, for sequences decode prefills itself ([] when its KV came with it)
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    use_cache: bool = True  # params.use_cache, and the engine has a prefix cache
    num_reused_tokens: int = 0  # leading prompt tokens whose K/V came from the prefix cache
    guide: Guide | None = field(default=None, repr=False)  # params' grammar, if it has one

    def guide_history(self) -> list[int]:
        """The tokens the grammar has consumed: what a migrated stream sent, then output."""
        return [*self.params.guide_tokens, *self.output_ids]

    def grammar_stop(self) -> FinishReason | None:
        """STOP once the grammar is complete, GRAMMAR once it allows nothing; else None."""
        if self.guide is None:
            return None
        self.guide.sync(self.guide_history())
        if self.guide.dead:
            return FinishReason.GRAMMAR
        return FinishReason.STOP if self.guide.finished else None

    @property
    def prefilling(self) -> bool:
        return self.prefill_pos is not None and not self.output_ids

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def num_cached_tokens(self) -> int:
        if self.prefilling and self.prefill_pos is not None:  # (prefilling: it is)
            return self.prefill_pos
        return self.num_tokens - 1

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def max_num_tokens(self) -> int:
        """KV positions this sequence may ever need (reserved at admission)."""
        return self.prompt_len + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def validate_request(
    args: ModelArgs, config: EngineConfig, prompt_ids: list[int], params: SamplingParams
) -> None:
    """Everything a request can get wrong, checked before any work is done for it."""
    if not prompt_ids:
        raise RequestError("prompt is empty")
    if len(prompt_ids) >= config.max_model_len:
        raise RequestError(
            f"prompt has {len(prompt_ids)} tokens; the context limit is "
            f"{config.max_model_len} (prompt + output)"
        )
    if any(not 0 <= t < args.vocab_size for t in prompt_ids):
        raise RequestError(f"prompt token ids must be in [0, {args.vocab_size})")
    params.validate(args.vocab_size, config.max_tokens_limit)
    if len(prompt_ids) + params.max_tokens > config.max_model_len:
        raise RequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"the context limit of {config.max_model_len} tokens"
        )
