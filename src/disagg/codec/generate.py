"""The client-facing messages, declared once for the router, the orchestrator, the tokenizer
and the ensemble, and for everything that calls them (the gateway, disagg.client):

    client --RouterRequest--> router --OrchestratorRequest--> orchestrator
    client <--RouterReply---- router <--OrchestratorReply---- orchestrator
    ensemble: TokenizeCall -> tokenizer -> TokenizeResponse (input_ids) -> orchestrator

Client-facing names, dtypes and shapes are the TensorRT-LLM ensemble's, so its clients work
unchanged; codec/fields.py reads them for both the router and the orchestrator.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
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
        _optional(C.RETURN_LOG_PROBS, np.bool_),
        _optional(C.TOP_LOGPROBS, np.int32),
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
        _optional(C.OPENAI_TOOLS, np.object_),
    )
)
_INPUT_IDS = TensorSpec(C.INPUT_IDS, np.int32, (-1,))
# The ensemble's outputs, on every response of the router, the orchestrator, the ensemble.
CLIENT_OUTPUTS = Tensors(
    (
        TensorSpec(C.TEXT_OUTPUT, np.object_, (-1,)),
        TensorSpec(C.NUM_INPUT_TOKENS, np.int32),
        TensorSpec(C.NUM_OUTPUT_TOKENS, np.int32),
        TensorSpec(C.FINISH_REASON, np.object_),
    )
)
# The response's tokens' log-probabilities, as TensorRT-LLM's output (beams x tokens: one
# beam; on every response, empty unless return_log_probs) and, with return_log_probs, as
# OpenAI's objects (the tokens' text, the top alternatives), which the gateway passes on
_OUTPUT_LOG_PROBS = TensorSpec(C.OUTPUT_LOG_PROBS, np.float32, (-1, -1))
LOGPROB_OUTPUTS = Tensors((_OUTPUT_LOG_PROBS, TensorSpec(C.OUTPUT_LOGPROBS_CONTENT, np.object_)))
ENSEMBLE_INPUTS = GENERATION + PROMPT_FORMS  # the ensemble: the router's inputs minus hints
ENSEMBLE_OUTPUTS = CLIENT_OUTPUTS + Tensors((_OUTPUT_LOG_PROBS,))


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
    values: dict[str, Any] = {
        C.TEXT_OUTPUT: reply.text,
        C.NUM_INPUT_TOKENS: reply.num_input_tokens,
        C.NUM_OUTPUT_TOKENS: reply.num_output_tokens,
        C.FINISH_REASON: reply.finish_reason or "",
    }
    # always, as TensorRT-LLM's ensemble (empty unless asked): an ensemble maps it from every
    # response of the orchestrator
    values[C.OUTPUT_LOG_PROBS] = [float(t["logprob"]) for t in reply.logprobs or ()]
    if reply.logprobs is not None:
        values[C.OUTPUT_LOGPROBS_CONTENT] = json.dumps(reply.logprobs)
    return values


def read_logprobs(arrays: Mapping[str, Array]) -> list[dict[str, Any]] | None:
    """OUTPUT_LOGPROBS_CONTENT of a response, when it carries it."""
    return _read_json_list(arrays, C.OUTPUT_LOGPROBS_CONTENT)


def _read_json_list(arrays: Mapping[str, Array], name: str) -> list[dict[str, Any]] | None:
    value = arrays.get(name)
    if value is None:
        return None
    content = json.loads(value.reshape(-1)[0])
    if not isinstance(content, list):
        raise ValueError(f"{name} is not a JSON array")
    return content


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
    TENSORS = CLIENT_OUTPUTS + LOGPROB_OUTPUTS + EXTRAS + ACK + FAILURE
    # what the router asks for: the reply, who served it, and the BLS contract's outputs
    REQUESTED_BY_ROUTER = (
        *CLIENT_OUTPUTS.names, C.OUTPUT_LOGPROBS_CONTENT, C.SERVED_BY, C.NUM_CACHED_TOKENS,
        *ACK.names, *FAILURE.names,
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
            logprobs=read_logprobs(arrays),
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
    TOOL_CALLS = Tensors((TensorSpec(C.OUTPUT_TOOL_CALLS, np.object_),))  # when relayed
    # + the acknowledgement a client asks for with contracts.ACK_PARAM (the gateway)
    TENSORS = CLIENT_OUTPUTS + LOGPROB_OUTPUTS + TOOL_CALLS + EXTRAS + ACK

    @staticmethod
    def encode(reply: RoutedReply, batched: bool) -> Arrays:
        values = _client_values(reply)
        if reply.tool_calls:
            values[C.OUTPUT_TOOL_CALLS] = json.dumps(reply.tool_calls)
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
            logprobs=read_logprobs(arrays),
            tool_calls=_read_json_list(arrays, C.OUTPUT_TOOL_CALLS),
        )

    @staticmethod
    def extras(arrays: Mapping[str, Array]) -> dict[str, str]:
        """The routing outputs present (on the final response)."""
        names = RouterReply.ROUTING.names
        return {name: str(scalar(arrays[name])) for name in names if name in arrays}
