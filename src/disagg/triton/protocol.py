"""Tensor names and the data contracts between the Triton models. Every name is defined here once.

Client-facing names follow the TensorRT-LLM ensemble, so its clients work unchanged.
Internal names (prefill, decode) carry disagg's own contracts: sampling parameters travel as
one JSON string, the KV cache as the bytes of a `KVPayload`.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from disagg.errors import (
    CapacityError,
    DisaggError,
    EngineDeadError,
    PoolError,
    RequestError,
)
from disagg.sequence import SamplingParams

# ------------------------------------------------------------------ client-facing (ensemble)
TEXT_INPUT = "text_input"
MESSAGES = "messages"  # optional JSON list of {role, content}: rendered with the chat template
APPLY_CHAT_TEMPLATE = "apply_chat_template"  # optional BOOL: wrap text_input as a user turn
MAX_TOKENS = "max_tokens"
STREAM = "stream"
TEMPERATURE = "temperature"
TOP_K = "top_k"
TOP_P = "top_p"
SEED = "seed"
STOP_WORDS = "stop_words"
BAD_WORDS = "bad_words"
END_ID = "end_id"
PAD_ID = "pad_id"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
IGNORE_EOS = "ignore_eos"  # BOOL: generate max_tokens tokens (vLLM's name; benchmarks use it)

# router-only inputs: routing hints (all optional)
MODEL = "model"  # public model name (the OpenAI `model`); routing rules may match on it
LATENCY_SLA_MS = "latency_sla_ms"  # FP32: the client's latency target
TASK_TYPE = "task_type"  # e.g. "interactive", "batch_offline"
PRIORITY = "priority"  # INT32: larger is more urgent

TEXT_OUTPUT = "text_output"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
FINISH_REASON = "finish_reason"

# How the orchestrator reads the client-facing generation inputs (pb.read_fields kinds); the
# router takes the same and forwards them to the orchestrator unchanged.
GENERATION_INPUTS = {
    TEXT_INPUT: "str",
    MAX_TOKENS: "int",
    STREAM: "bool",
    TEMPERATURE: "float",
    TOP_K: "int",
    TOP_P: "float",
    SEED: "int",
    STOP_WORDS: "strs",
    BAD_WORDS: "strs",
    END_ID: "int",
    PAD_ID: "int",
    EXCLUDE_INPUT_IN_OUTPUT: "bool",
    RETURN_NUM_INPUT_TOKENS: "bool",
    RETURN_NUM_OUTPUT_TOKENS: "bool",
    IGNORE_EOS: "bool",
}

# ------------------------------------------------------------------ tokenizer -> orchestrator
INPUT_IDS = "input_ids"  # INT32 [-1]

# ------------------------------------------------------------------ orchestrator <-> pools
PROMPT_IDS = "prompt_ids"  # INT32 [-1]
SAMPLING = "sampling"  # BYTES [1]: JSON of SamplingParams (+ "seed" resolved)
FIRST_TOKEN = "first_token"  # INT32 [1]
RESOLVED_SEED = "resolved_seed"  # UINT64 [1]
KV_PAYLOAD = "kv_payload"  # UINT8 [-1]: KVPayload.to_bytes()
PREFILL_TIME_US = "prefill_time_us"  # INT64 [1]: compute only
PREFILL_START_NS = "prefill_start_ns"  # INT64 [1]: wall clock when compute began (queue time)
TOKEN_IDS = "token_ids"  # INT32 [-1]: new tokens of one decode response
WORKER_PID = "worker_pid"  # INT32 [1]: the process that produced a response
PREFILL_PID = "prefill_pid"  # INT32 [1]: orchestrator's final response (0: no prefill pool)
DECODE_PID = "decode_pid"  # INT32 [1]
KV_BYTES = "kv_bytes"  # INT64 [1]: orchestrator's final response
KV_HANDOFF_US = "kv_handoff_us"  # INT64 [1]
SERVED_BY = "served_by"  # BYTES [1]: "disaggregated" | "colocated" | "fallback" | endpoint
# ------------------------------------------------------------------ router's final response
ROUTE_TARGET = "route_target"  # BYTES [1]: the policy target that served the request
ROUTE_REASON = "route_reason"  # BYTES [1]: rule name, "default", or why it fell back
ERROR = "error"  # BYTES [1]: with finish_reason "error": what failed after text was sent

# ------------------------------------------------------------------ failures inside a BLS stream
# Triton 2.51 drops an error response that a decoupled model sends after its first response
# when the caller is a BLS stream (the caller's response iterator waits forever; a client of
# the HTTP/gRPC endpoints or an ensemble gets it). So a model called by another model is asked,
# through a request parameter, to acknowledge at once (a response with WORKER_PID alone: the
# process the caller watches) and to send a failure as the outputs of an ordinary final
# response: ERROR_KIND (one of ERROR_KINDS) and ERROR (the message).
CALLER_PARAM = "disagg_caller"  # request parameter; value BLS_CALLER
BLS_CALLER = "bls"
# The internal models (prefill, decode) answer only BLS calls of their own server: the call
# carries this server's token (request parameter TOKEN_PARAM), which `disagg serve` makes per
# start and hands to tritonserver in the environment (readable by its owner alone, unlike
# the command line). A request from Triton's HTTP/gRPC ports cannot know it.
TOKEN_PARAM = "disagg_token"
# The caller's pid (request parameter): a callee stops a request whose caller died. Triton
# 2.51 neither cancels a dead stub's BLS requests nor drops their responses: they queue up
# for the dead process until the callee's send blocks (a killed orchestrator stalled
# decode's engine loop, and with it every other request, for good).
CALLER_PID_PARAM = "disagg_caller_pid"
TOKEN_ENV = "DISAGG_INTERNAL_TOKEN"
ERROR_KIND = "error_kind"  # BYTES [1]: "" on success
INVALID_REQUEST, UNAVAILABLE, INTERNAL = "invalid_request", "unavailable", "internal"
ERROR_KINDS = (INVALID_REQUEST, UNAVAILABLE, INTERNAL)


def error_kind_of(exc: BaseException) -> str:
    """The kind of a failure, as it travels between models and in metric labels."""
    if isinstance(exc, RequestError):
        return INVALID_REQUEST
    if isinstance(exc, (CapacityError, PoolError, EngineDeadError)):
        return UNAVAILABLE
    return INTERNAL


def error_from_kind(kind: str, message: str, where: str) -> DisaggError:
    """The exception a caller raises for a failure a model behind it reported: a bad request
    stays the client's error; anything else is the pool's, so the caller may route around it."""
    if kind == INVALID_REQUEST:
        return RequestError(message)
    return PoolError(f"{where}: {message}")


def sampling_to_json(params: SamplingParams) -> str:
    return json.dumps(asdict(params))


def sampling_from_json(text: str) -> SamplingParams:
    try:
        data = json.loads(text)
        data["stop_token_ids"] = tuple(data.get("stop_token_ids", ()))
        data["stop"] = tuple(data.get("stop", ()))
        data["bad_words_ids"] = tuple(tuple(w) for w in data.get("bad_words_ids", ()))
        return SamplingParams(**data)
    except (ValueError, TypeError) as e:
        raise RequestError(f"malformed sampling parameters: {e}") from e
