"""Grammar-constrained decoding: token masks from llguidance (benchmarks/grammar_bench.py and
docs/structured-outputs.md say why this library).

A request's constraint is two strings in its SamplingParams (`guide_type`, `guide`), the
names TensorRT-LLM's Triton backend takes. Its state is never shipped: a `Guide` is rebuilt
wherever the request runs and brought up to date by replaying the tokens the sequence holds
(`SamplingParams.guide_tokens`, what a migrated stream already sent, then its own output).
So prefill's first token, decode's next ones, a stream taken over by another decode
instance or server all follow one grammar, with nothing added to the KV hand-off; replay
costs a few microseconds a token.

The grammar decides when it is complete: a sequence whose guide is finished stops (STOP)
even under `ignore_eos`; one whose guide allows no token at all (a grammar that reached a
dead end, or the library's per-step limits) stops with FinishReason.GRAMMAR, never with a
token the grammar refuses.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from disagg.errors import RequestError

if TYPE_CHECKING:
    from disagg.engine.tokenizer import Tokenizer


class Guided(Protocol):
    """What a guide is read from (SamplingParams; sequence.py imports this module's Guide)."""

    @property
    def guide_type(self) -> str: ...

    @property
    def guide(self) -> str: ...


# compact JSON, as json.dumps writes it: a small model left free to add whitespace may emit
# newlines until max_tokens
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def to_llguidance(guide_type: str, guide: str) -> str:
    """A guide -> llguidance's grammar definition. Raises RequestError on text that does not
    parse (a schema that is not JSON, a GBNF grammar that does not convert)."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        if guide_type == "json":
            return _json_grammar(llguidance, {"type": "object"})
        if guide_type == "json_schema":
            schema = json.loads(guide)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is a JSON object")
            return _json_grammar(llguidance, schema)
        if guide_type == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(guide))
        lark = any_to_lark(guide) if guide_type == "ebnf_grammar" else guide
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - the library's errors name what is wrong
        raise RequestError(f"the {guide_type} guide does not parse: {_short(e)}") from e


def _json_grammar(llguidance: Any, schema: dict[str, Any], lenient: bool = False) -> str:
    """`lenient`: keywords llguidance does not implement are ignored rather than refused."""
    options = {**JSON_OPTIONS, "lenient": lenient} if lenient else JSON_OPTIONS
    return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))


@functools.lru_cache(maxsize=256)  # (clients send the same schema on every call)
def check_syntax(guide_type: str, guide: str) -> None:
    """Whether the guide is a valid grammar at all, no vocabulary needed (the gateway asks,
    to name the field that carried it; the orchestrator still compiles it for the model).
    Raises RequestError with the library's reason; a process without llguidance (an image
    that serves no guides) skips the check and leaves it to the orchestrator."""
    try:
        import llguidance
    except ImportError:
        return
    _validate(llguidance, to_llguidance(guide_type, guide), guide_type)


def check_schema(schema: dict[str, Any], lenient: bool) -> None:
    """Whether a JSON schema (a tool's parameters) compiles; `lenient`: keywords llguidance
    does not implement (uniqueItems, not, unknown formats) are ignored, as they are where
    no grammar is built from it, and only a malformed schema is refused."""
    try:
        import llguidance
    except ImportError:
        return
    try:
        grammar = _json_grammar(llguidance, schema, lenient)
    except Exception as e:  # noqa: BLE001 - the library's errors name what is wrong
        raise RequestError(f"the JSON schema does not parse: {_short(e)}") from e
    _validate(llguidance, grammar, "JSON schema")


def _validate(llguidance: Any, grammar: str, what: str) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise RequestError(f"the {what} guide does not compile: {_short(messages[0])}")


def _short(e: object, limit: int = 300) -> str:
    text = str(e).strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


class Grammars:
    """One process's grammar compiler for one vocabulary (the engine's tokenizer.json)."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_id: int) -> None:
        import llguidance

        self._ll = llguidance
        text = Path(tokenizer_json).read_text(encoding="utf-8")
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_token_id)
        # ParserLimits' defaults bound a mask's work per step (lexer fuel, Earley items)
        # and a grammar's size; errors are terse (no schema text in a message or a log)
        self.limits = llguidance.LLParserLimits(verbose_errors=False)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def for_engine(engine_dir: str, vocab_size: int, eos_token_id: int) -> Grammars:
        from disagg.engine.config import TOKENIZER_FILE

        return Grammars(Path(engine_dir) / TOKENIZER_FILE, vocab_size, eos_token_id)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one per process, lives as long
    def compile(self, guide_type: str, guide: str) -> str:
        """Check the guide compiles against this vocabulary; returns llguidance's grammar."""
        grammar = to_llguidance(guide_type, guide)
        is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            raise RequestError(f"the {guide_type} guide does not compile: {_short(messages[0])}")
        return grammar

    def guide(self, guide_type: str, guide: str) -> Guide:
        grammar = self.compile(guide_type, guide)
        return Guide(self._ll.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits))


class Guide:
    """One sequence's grammar state, advanced to the tokens it is given (replayed from the
    start when they are not an extension of what it has seen)."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self._seen: list[int] = []
        self._lock = threading.Lock()
        self.dead = False  # a token the grammar refused, or no token left to allow

    def sync(self, tokens: Sequence[int]) -> None:
        with self._lock:
            n = len(self._seen)
            if len(tokens) < n or list(tokens[:n]) != self._seen:
                self._matcher.reset()
                self._seen, self.dead, n = [], False, 0
            for t in tokens[n:]:
                if not self._matcher.consume_token(int(t)):
                    self.dead = True
                self._seen.append(int(t))

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing more may follow (EOS, if it came, included)."""
        return bool(self._matcher.is_stopped())

    def allowed(self, tokens: Sequence[int], vocab_size: int) -> npt.NDArray[np.bool_] | None:
        """A bool [vocab_size] mask of the tokens the grammar allows after `tokens`, or None
        when it allows none (then `dead` is set)."""
        self.sync(tokens)
        with self._lock:
            if self.dead or self._matcher.is_error():
                self.dead = True
                return None
            bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)
        if mask.shape[0] < vocab_size:  # (the tokenizer's vocabulary is the model's)
            mask = np.pad(mask, (0, vocab_size - mask.shape[0]))
        if not mask.any():
            self.dead = True
            return None
        return mask


def guide_for(model: object, eos_token_ids: Collection[int], params: Guided) -> Guide | None:
    """The Guide a request needs (None without one), from the engine's compiler for its
    model's vocabulary; RequestError when the guide does not compile, or the model was made
    in memory (as unit tests make them: no tokenizer)."""
    if not params.guide_type:
        return None
    engine_dir, args = getattr(model, "engine_dir", None), getattr(model, "args", None)
    if engine_dir is None or args is None or not eos_token_ids:
        raise RequestError("this engine has no tokenizer: guided decoding is unavailable")
    grammars = Grammars.for_engine(str(engine_dir), int(args.vocab_size), min(eos_token_ids))
    return grammars.guide(params.guide_type, params.guide)


def check_guide(tokenizer: Tokenizer, vocab_size: int, params: Guided) -> None:
    """Whether the request's guide compiles against this model's vocabulary (the
    orchestrator asks before any pool works: a 400, not a failed prefill)."""
    if params.guide_type:
        if tokenizer.eos_token_id is None:
            raise RequestError("this model has no EOS token: guided decoding is unavailable")
        grammars = Grammars.for_engine(
            str(tokenizer.engine_dir), vocab_size, tokenizer.eos_token_id
        )
        grammars.compile(params.guide_type, params.guide)
