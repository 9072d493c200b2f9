"""The client's generation inputs (codec/generate.py's GENERATION tensors) as plain values
with one set of defaults, as the router (routing/request.py) and the orchestrator
(pipeline/request.py) both read them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg import contracts as C
from disagg.errors import RequestError

EXCLUDE_INPUT_DEFAULT = False  # TensorRT-LLM's: a reply starts with its prompt unless asked


@dataclass(frozen=True)
class GenerationFields:
    """The client's generation inputs as plain values with their defaults, as the router
    (routing/request.py) and the orchestrator (pipeline/orchestrator.py) both read them."""

    text_input: str = ""
    max_tokens: int | None = None  # None: the server's max_tokens_default
    stream: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: a random seed per request
    stop_words: tuple[str, ...] = ()  # empty strings dropped (TensorRT-LLM clients send [""])
    bad_words: tuple[str, ...] = ()  # the same
    end_id: int | None = None
    pad_id: int | None = None
    exclude_input_in_output: bool = EXCLUDE_INPUT_DEFAULT
    ignore_eos: bool = False
    cache_salt: str = ""
    use_prefix_cache: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_length: int = 0  # min_tokens
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), from LOGIT_BIAS's JSON
    guide_type: str = ""  # guided decoding: engine/grammar.py
    guide: str = ""
    return_log_probs: bool = False
    top_logprobs: int = 0  # with return_log_probs: alternatives per token

    @classmethod
    def parse(cls, fields: Mapping[str, Any]) -> GenerationFields:
        """`fields`: present inputs only, as `Tensors.read` returns them."""

        def opt_int(name: str) -> int | None:
            return None if fields.get(name) is None else int(fields[name])

        return cls(
            text_input=fields.get(C.TEXT_INPUT, ""),
            max_tokens=opt_int(C.MAX_TOKENS),
            stream=bool(fields.get(C.STREAM, False)),
            temperature=float(fields.get(C.TEMPERATURE, 0.0)),
            top_k=int(fields.get(C.TOP_K, 0)),
            top_p=float(fields.get(C.TOP_P, 1.0)),
            seed=opt_int(C.SEED),
            stop_words=tuple(s for s in fields.get(C.STOP_WORDS, []) if s),
            bad_words=tuple(w for w in fields.get(C.BAD_WORDS, []) if w),
            end_id=opt_int(C.END_ID),
            pad_id=opt_int(C.PAD_ID),
            exclude_input_in_output=bool(
                fields.get(C.EXCLUDE_INPUT_IN_OUTPUT, EXCLUDE_INPUT_DEFAULT)
            ),
            ignore_eos=bool(fields.get(C.IGNORE_EOS, False)),
            cache_salt=str(fields.get(C.CACHE_SALT, "")),
            use_prefix_cache=bool(fields.get(C.USE_PREFIX_CACHE, True)),
            presence_penalty=float(fields.get(C.PRESENCE_PENALTY, 0.0)),
            frequency_penalty=float(fields.get(C.FREQUENCY_PENALTY, 0.0)),
            repetition_penalty=float(fields.get(C.REPETITION_PENALTY, 1.0)),
            min_length=int(fields.get(C.MIN_LENGTH, 0)),
            stop_token_ids=tuple(int(t) for t in fields.get(C.STOP_TOKEN_IDS, [])),
            logit_bias=parse_logit_bias(fields.get(C.LOGIT_BIAS, "")),
            guide_type=str(fields.get(C.GUIDED_DECODING_GUIDE_TYPE, "")),
            guide=str(fields.get(C.GUIDED_DECODING_GUIDE, "")),
            return_log_probs=bool(fields.get(C.RETURN_LOG_PROBS, False)),
            top_logprobs=int(fields.get(C.TOP_LOGPROBS, 0)),
        )

    @property
    def logprobs(self) -> int | None:
        """SamplingParams.logprobs: None unless return_log_probs. Raises RequestError for
        top_logprobs without it."""
        if not self.return_log_probs:
            if self.top_logprobs:
                raise RequestError(f"{C.TOP_LOGPROBS} needs {C.RETURN_LOG_PROBS} true")
            return None
        return self.top_logprobs


def parse_logit_bias(text: str) -> tuple[tuple[int, float], ...]:
    """LOGIT_BIAS's JSON object ({"token id": bias}, OpenAI's shape) as (id, bias) pairs;
    the ranges are SamplingParams.validate's to check."""
    if not text:
        return ()
    try:
        body = json.loads(text)
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        return tuple((int(k), float(v)) for k, v in body.items())
    except (ValueError, TypeError) as e:
        raise RequestError(
            f'{C.LOGIT_BIAS} must be a JSON object of token ids to biases ({{"42": -100}}): {e}'
        ) from e
