"""The client-facing messages, declared once for the router, the orchestrator, the tokenizer
and the ensemble, and for everything that calls them (the gateway, disagg.client):

    client --RouterRequest--> router --OrchestratorRequest--> orchestrator
    client <--RouterReply---- router <--OrchestratorReply---- orchestrator
    ensemble: TokenizeCall -> tokenizer -> TokenizeResponse (input_ids) -> orchestrator

Client-facing names, dtypes and shapes are the TensorRT-LLM ensemble's, so its clients work
unchanged. `GenerationFields` is how both the router and the orchestrator read them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg import contracts as C
from disagg.codec.tensors import (
    ACK,
    FAILURE,
    Array,
    Arrays,
    Tensors,
    TensorSpec,
    required,
    scalar,
)
from disagg.contracts import Reply, RoutedReply
from disagg.errors import RequestError


def _optional(name: str, dtype: type, dims: tuple[int, ...] = (1,)) -> TensorSpec:
    return TensorSpec(name, dtype, dims, optional=True)


_TEXT_INPUT = _optional(C.TEXT_INPUT, np.object_)
# The client's generation inputs, all optional: a client leaves out what it does not set.
GENERATION = Tensors(
    (
        _TEXT_INPUT,
        _optional(C.MAX_TOKENS, np.int32),
        _optional(C.STREAM, np.bool_),
        _optional(C.TEMPERATURE, np.float32),
        _optional(C.TOP_K, np.int32),
        _optional(C.TOP_P, np.float32),
        _optional(C.SEED, np.uint64),
        _optional(C.STOP_WORDS, np.object_, (-1,)),
        _optional(C.BAD_WORDS, np.object_, (-1,)),
        _optional(C.END_ID, np.int32),
        _optional(C.PAD_ID, np.int32),
        _optional(C.EXCLUDE_INPUT_IN_OUTPUT, np.bool_),
        _optional(C.IGNORE_EOS, np.bool_),
        _optional(C.CACHE_SALT, np.object_),
        _optional(C.USE_PREFIX_CACHE, np.bool_),
        _optional(C.RETURN_NUM_INPUT_TOKENS, np.bool_),
        _optional(C.RETURN_NUM_OUTPUT_TOKENS, np.bool_),
        _optional(C.PRESENCE_PENALTY, np.float32),
        _optional(C.FREQUENCY_PENALTY, np.float32),
        _optional(C.REPETITION_PENALTY, np.float32),
        _optional(C.MIN_LENGTH, np.int32),
        _optional(C.STOP_TOKEN_IDS, np.int32, (-1,)),
        _optional(C.LOGIT_BIAS, np.object_),
        _optional(C.GUIDED_DECODING_GUIDE_TYPE, np.object_),
        _optional(C.GUIDED_DECODING_GUIDE, np.object_),
    )
)
# the prompt as chat messages, or text to wrap as a user turn (the router or the tokenizer
# renders the chat template)
PROMPT_FORMS = Tensors(
    (_optional(C.MESSAGES, np.object_), _optional(C.APPLY_CHAT_TEMPLATE, np.bool_))
)
ROUTING_HINTS = Tensors(
    (
        _optional(C.MODEL, np.object_),
        _optional(C.LATENCY_SLA_MS, np.float32),
        _optional(C.TASK_TYPE, np.object_),
        _optional(C.PRIORITY, np.int32),
    )
)
_INPUT_IDS = TensorSpec(C.INPUT_IDS, np.int32, (-1,))
# The ensemble's four outputs, on every response of the router, the orchestrator, the ensemble.
CLIENT_OUTPUTS = Tensors(
    (
        TensorSpec(C.TEXT_OUTPUT, np.object_, (-1,)),
        TensorSpec(C.NUM_INPUT_TOKENS, np.int32),
        TensorSpec(C.NUM_OUTPUT_TOKENS, np.int32),
        TensorSpec(C.FINISH_REASON, np.object_),
    )
)
ENSEMBLE_INPUTS = GENERATION + PROMPT_FORMS  # the ensemble: the router's inputs minus hints


# ------------------------------------------------------------------ the client's fields

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
        )


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


# ------------------------------------------------------------------ requests


class RouterRequest:
    """client -> router: generation inputs, the prompt as text or chat messages, and
    routing hints (the gateway sends these)."""

    TENSORS = GENERATION + PROMPT_FORMS + ROUTING_HINTS

    @staticmethod
    def encode(fields: Mapping[str, Any]) -> Arrays:
        return RouterRequest.TENSORS.encode(fields, batched=True)

    @staticmethod
    def decode(arrays: Mapping[str, Array]) -> dict[str, Any]:
        return RouterRequest.TENSORS.read(arrays, batched=True)


class OrchestratorRequest:
    """router, or the ensemble's tokenizer step -> orchestrator: the prompt's token ids and
    the client's generation inputs as the client sent them."""

    TENSORS = Tensors((_INPUT_IDS,)) + GENERATION

    @staticmethod
    def encode(fields: Mapping[str, Any]) -> Arrays:
        return OrchestratorRequest.TENSORS.encode(fields, batched=True)

    @staticmethod
    def decode(arrays: Mapping[str, Array]) -> dict[str, Any]:
        return OrchestratorRequest.TENSORS.read(arrays, batched=True)


class TokenizeCall:
    """ensemble -> tokenizer: the prompt, as text or chat messages."""

    TENSORS = Tensors((_TEXT_INPUT,)) + PROMPT_FORMS

    @staticmethod
    def decode(arrays: Mapping[str, Array]) -> tuple[str, str, bool]:
        """(text, messages as JSON, whether to wrap the text as a user turn)."""
        f = TokenizeCall.TENSORS.read(arrays, batched=True)
        chat = bool(f.get(C.APPLY_CHAT_TEMPLATE, False))
        return f.get(C.TEXT_INPUT, ""), f.get(C.MESSAGES, ""), chat


class TokenizeResponse:
    """tokenizer -> ensemble: the prompt's token ids."""

    TENSORS = Tensors((_INPUT_IDS,))

    @staticmethod
    def encode(ids: list[int]) -> Arrays:
        return TokenizeResponse.TENSORS.encode({C.INPUT_IDS: ids}, batched=True)


def client_inputs(fields: Mapping[str, Any]) -> Arrays:
    """What disagg.client sends any entry model (router, ensemble, orchestrator): each input
    with its declared dtype. A name no entry model takes goes as its Python type, for Triton
    to refuse."""
    known = RouterRequest.TENSORS + Tensors((_INPUT_IDS,))
    arrays = known.encode({k: v for k, v in fields.items() if k in known.names}, batched=True)
    for name, value in fields.items():
        if name not in arrays:
            values = value if isinstance(value, list) else [value]
            dtype = _PYTHON_DTYPES[type(values[0])]
            arrays[name] = TensorSpec(name, dtype, (-1,)).array(values, batched=True)
    return arrays


_PYTHON_DTYPES = {str: np.object_, bool: np.bool_, int: np.int32, float: np.float32}


# ------------------------------------------------------------------ replies


def _client_values(reply: Reply | RoutedReply) -> dict[str, Any]:
    return {
        C.TEXT_OUTPUT: reply.text,
        C.NUM_INPUT_TOKENS: reply.num_input_tokens,
        C.NUM_OUTPUT_TOKENS: reply.num_output_tokens,
        C.FINISH_REASON: reply.finish_reason or "",
    }


class OrchestratorReply:
    """orchestrator -> its caller: a `Reply`, a delta while streaming; the final one also
    says where it was served. A BLS caller (the router) also gets the acknowledgement and
    failures as outputs."""

    EXTRAS = Tensors(
        (
            TensorSpec(C.SERVED_BY, np.object_),
            TensorSpec(C.PREFILL_PID, np.int32),
            TensorSpec(C.DECODE_PID, np.int32),
            TensorSpec(C.KV_BYTES, np.int64),
            TensorSpec(C.KV_HANDOFF_US, np.int64),
            TensorSpec(C.NUM_CACHED_TOKENS, np.int32),
        )
    )  # final response only
    TENSORS = CLIENT_OUTPUTS + EXTRAS + ACK + FAILURE
    # what the router asks for: the reply, who served it, and the BLS contract's outputs
    REQUESTED_BY_ROUTER = (
        *CLIENT_OUTPUTS.names, C.SERVED_BY, C.NUM_CACHED_TOKENS, *ACK.names, *FAILURE.names
    )  # fmt: skip

    @staticmethod
    def encode(reply: Reply, batched: bool) -> Arrays:
        values = _client_values(reply)
        if reply.finish_reason is not None:
            values |= {
                C.SERVED_BY: reply.served_by,
                C.PREFILL_PID: reply.prefill_pid,
                C.DECODE_PID: reply.decode_pid,
                C.KV_BYTES: reply.kv_bytes,
                C.KV_HANDOFF_US: int(reply.kv_handoff_s * 1e6),
                C.NUM_CACHED_TOKENS: reply.num_cached_tokens,
            }
        return OrchestratorReply.TENSORS.encode(values, batched)

    @staticmethod
    def decode(arrays: Mapping[str, Array]) -> RoutedReply | None:
        """The router's view of one response; None for the acknowledgement and the empty
        response that carries FINAL."""
        if C.TEXT_OUTPUT not in arrays:
            return None
        served = arrays.get(C.SERVED_BY)
        cached = arrays.get(C.NUM_CACHED_TOKENS)
        reason = required(arrays, C.FINISH_REASON)[0].decode()
        return RoutedReply(
            text=required(arrays, C.TEXT_OUTPUT)[0].decode("utf-8"),
            num_input_tokens=int(required(arrays, C.NUM_INPUT_TOKENS)[0]),
            num_output_tokens=int(required(arrays, C.NUM_OUTPUT_TOKENS)[0]),
            finish_reason=reason or None,
            served_by="" if served is None else served.reshape(-1)[0].decode(),
            num_cached_tokens=0 if cached is None else int(cached.reshape(-1)[0]),
        )


class RouterReply:
    """router -> its client: a `RoutedReply`; the final one also says where it was routed."""

    ROUTING = Tensors(
        tuple(
            TensorSpec(name, np.object_)
            for name in (C.ROUTE_TARGET, C.ROUTE_REASON, C.SERVED_BY, C.ERROR)
        )
    )
    EXTRAS = ROUTING + Tensors((TensorSpec(C.NUM_CACHED_TOKENS, np.int32),))  # final only
    TENSORS = CLIENT_OUTPUTS + EXTRAS

    @staticmethod
    def encode(reply: RoutedReply, batched: bool) -> Arrays:
        values = _client_values(reply)
        if reply.finish_reason is not None:
            values |= {
                C.ROUTE_TARGET: reply.target,
                C.ROUTE_REASON: reply.reason,
                C.SERVED_BY: reply.served_by,
                C.ERROR: reply.error,
                C.NUM_CACHED_TOKENS: reply.num_cached_tokens,
            }
        return RouterReply.TENSORS.encode(values, batched)

    @staticmethod
    def decode(arrays: Mapping[str, Array]) -> RoutedReply:
        """A client's view of one response: absent outputs read as empty."""
        extras = RouterReply.extras(arrays)
        return RoutedReply(
            text=str(scalar(arrays.get(C.TEXT_OUTPUT)) or ""),
            num_input_tokens=int(scalar(arrays.get(C.NUM_INPUT_TOKENS)) or 0),
            num_output_tokens=int(scalar(arrays.get(C.NUM_OUTPUT_TOKENS)) or 0),
            finish_reason=str(scalar(arrays.get(C.FINISH_REASON)) or "") or None,
            target=extras.get(C.ROUTE_TARGET, ""),
            reason=extras.get(C.ROUTE_REASON, ""),
            served_by=extras.get(C.SERVED_BY, ""),
            error=extras.get(C.ERROR, ""),
            num_cached_tokens=int(scalar(arrays.get(C.NUM_CACHED_TOKENS)) or 0),
        )

    @staticmethod
    def extras(arrays: Mapping[str, Array]) -> dict[str, str]:
        """The routing outputs present (on the final response)."""
        names = RouterReply.ROUTING.names
        return {name: str(scalar(arrays[name])) for name in names if name in arrays}
