"""The sampling fields of an OpenAI body -> router inputs: OpenAI's penalties, logit_bias,
logprobs and max_completion_tokens, and vLLM's extensions `repetition_penalty`, `min_tokens`,
`stop_token_ids`. Shapes and ranges are checked here (a 400 naming the field); token ids
against the vocabulary downstream (SamplingParams.validate, also a 400)."""

from __future__ import annotations

import json
from typing import Any

from disagg import contracts as C
from disagg.engine.sequence import MAX_LOGPROBS
from disagg.gateway.errors import bad_request, unsupported

INT32_MAX = 2**31 - 1
JSON = dict[str, Any]


def number(body: JSON, name: str, lo: float, hi: float, integer: bool = False) -> float | None:
    value: object = body.get(name)
    if value is None:
        return None
    is_int = isinstance(value, int)
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not is_int):
        kind = "an integer" if integer else "a number"
        raise bad_request(f"'{name}' must be {kind}, got {value!r}", name)
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo:g} and {hi:g}, got {value}", name)
    return value


MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_STOP_TOKEN_IDS = 64


def sampling_controls(body: JSON, inputs: dict[str, object]) -> None:
    """Penalties, logit_bias, min_tokens and stop_token_ids, checked here for their shape and
    range; token ids against the vocabulary downstream (SamplingParams.validate)."""
    for name, tensor, lo, hi in (
        ("presence_penalty", C.PRESENCE_PENALTY, -2.0, 2.0),
        ("frequency_penalty", C.FREQUENCY_PENALTY, -2.0, 2.0),
        ("repetition_penalty", C.REPETITION_PENALTY, 0.0, 100.0),
    ):
        value = number(body, name, lo, hi)
        if name == "repetition_penalty" and value == 0:
            raise bad_request("'repetition_penalty' must be > 0 (1: off)", name)
        if value is not None:
            inputs[tensor] = float(value)
    min_tokens = number(body, "min_tokens", 0, 1 << 20, integer=True)
    if min_tokens:
        inputs[C.MIN_LENGTH] = min_tokens
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if (
            not isinstance(stop_ids, list)
            or len(stop_ids) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)
            or not all(0 <= t <= INT32_MAX for t in stop_ids)
        ):
            raise bad_request(
                f"'stop_token_ids' must be an array of at most {MAX_STOP_TOKEN_IDS} token ids",
                "stop_token_ids",
            )
        if stop_ids:
            inputs[C.STOP_TOKEN_IDS] = stop_ids
    bias = body.get("logit_bias")
    if bias:
        inputs[C.LOGIT_BIAS] = json.dumps(_logit_bias(bias))


def _logit_bias(bias: object) -> dict[str, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, at most MAX_LOGIT_BIAS."""
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids",
            "logit_bias",
        )
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not -100 <= value <= 100:
            raise bad_request(
                f"'logit_bias' values must be numbers in [-100, 100], got {value!r}",
                "logit_bias",
            )
        out[str(int(key))] = float(value)
    return out


def max_tokens_of(body: JSON) -> float | None:
    """max_completion_tokens (OpenAI's current name) or max_tokens; both must agree."""
    new = number(body, "max_completion_tokens", 1, 1 << 20, integer=True)
    old = number(body, "max_tokens", 1, 1 << 20, integer=True)
    if new is not None and old is not None and new != old:
        raise bad_request(
            f"'max_completion_tokens' ({new}) and 'max_tokens' ({old}) disagree; send one",
            "max_completion_tokens",
        )
    return new if new is not None else old


def logprobs_fields(body: JSON, kind: str, inputs: dict[str, object]) -> bool:
    """Chat: `logprobs` (a boolean) and `top_logprobs` (alternatives, 0-20, only with
    logprobs). Completions: `logprobs`, the number of alternatives (OpenAI allows 5; 20
    here, as vLLM). Whether the reply carries logprobs."""
    value = body.get("logprobs")
    if kind == "chat":
        if value is not None and not isinstance(value, bool):
            raise bad_request("'logprobs' must be a boolean", "logprobs")
        top = number(body, "top_logprobs", 0, MAX_LOGPROBS, integer=True)
        if top is not None and not value:
            raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        on, alternatives = bool(value), int(top or 0)
    else:
        if body.get("top_logprobs") is not None:
            raise unsupported("top_logprobs", "completions take the count as 'logprobs'")
        top = number(body, "logprobs", 0, MAX_LOGPROBS, integer=True)
        on, alternatives = top is not None, int(top or 0)
    if on:
        inputs[C.RETURN_LOG_PROBS] = True
        if alternatives:
            inputs[C.TOP_LOGPROBS] = alternatives
    return on
