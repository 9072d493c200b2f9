"""Every contract that crosses a process or model boundary, defined once: tensor names, the
types that travel between stages, the request-id scheme, how an error's kind travels, and
the names of serving modes and admin credentials. No Triton here; everything imports it.

Client-facing names follow the TensorRT-LLM ensemble, so its clients work unchanged.
Internal names (prefill, decode) carry disagg's own contracts: sampling parameters travel as
one JSON string, the KV cache as the bytes of a `KVPayload`.
"""

from __future__ import annotations

import enum
import json
import os
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from disagg.engine.prefix_cache import PrefixCacheStats
from disagg.engine.sequence import SamplingParams, TokenLogprob
from disagg.errors import (
    CapacityError,
    DisaggError,
    EngineDeadError,
    KVPayloadError,
    KVPrefixMissError,
    PoolError,
    RequestError,
)

if TYPE_CHECKING:
    import numpy as np
import numpy.typing as npt

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
CACHE_SALT = "cache_salt"  # BYTES: the prefix cache's namespace for this request (vLLM's name)
USE_PREFIX_CACHE = "use_prefix_cache"  # BOOL, default true: false neither reads nor writes it
# sampling controls, TensorRT-LLM's names (its ensemble's inputs) where it has them
PRESENCE_PENALTY = "presence_penalty"  # FP32
FREQUENCY_PENALTY = "frequency_penalty"  # FP32
REPETITION_PENALTY = "repetition_penalty"  # FP32
MIN_LENGTH = "min_length"  # INT32: min_tokens (the LLM API's and vLLM's name)
STOP_TOKEN_IDS = "stop_token_ids"  # INT32 [-1]: besides end_id (the LLM API's and vLLM's)
LOGIT_BIAS = "logit_bias"  # BYTES: JSON {"token id": bias}, as OpenAI's (TensorRT-LLM: none)
# guided decoding, TensorRT-LLM's names: a type (json, json_schema, regex, ebnf_grammar, and
# disagg's lark) and its text (the schema, the regex, the grammar; none for json)
GUIDED_DECODING_GUIDE_TYPE = "guided_decoding_guide_type"  # BYTES
GUIDED_DECODING_GUIDE = "guided_decoding_guide"  # BYTES
# log-probabilities: TensorRT-LLM's switch and output (OUTPUT_LOG_PROBS: FP32 [-1], the
# response's tokens' own), and disagg's count of top alternatives per token (INT32, 0-20) and
# OpenAI's per-token objects ({token, logprob, bytes, top_logprobs}) as one JSON array
RETURN_LOG_PROBS = "return_log_probs"  # BOOL
TOP_LOGPROBS = "top_logprobs"  # INT32
OUTPUT_LOG_PROBS = "output_log_probs"  # FP32 [-1]
OUTPUT_LOGPROBS_CONTENT = "output_logprobs_content"  # BYTES [1]: JSON array

# router-only inputs: routing hints (all optional)
MODEL = "model"  # public model name (the OpenAI `model`); routing rules may match on it
LATENCY_SLA_MS = "latency_sla_ms"  # FP32: the client's latency target
TASK_TYPE = "task_type"  # e.g. "interactive", "batch_offline"
PRIORITY = "priority"  # INT32: larger is more urgent
# BYTES: JSON {"messages", "tools", "tool_choice", "parallel_tool_calls"}, the client's own
# (the gateway sets it with tools): what an OpenAI endpoint gets to serve the tools natively,
# while the local pipeline takes MESSAGES, the tools rendered into the chat template's text
OPENAI_TOOLS = "openai_tools"

TEXT_OUTPUT = "text_output"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
FINISH_REASON = "finish_reason"

# Which of these tensors make up each model's inputs and outputs, with their dtypes and
# shapes: disagg.codec (one codec per boundary message).

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
# INT32 [1], optional: leading prompt tokens (whole blocks) the prefill call's payload may leave
# out, because decode holds their K/V in its prefix cache
SKIP_TOKENS = "skip_tokens"
KV_START = "kv_start"  # INT32 [1]: the first prompt position prefill's payload holds (its skip)
TOKEN_IDS = "token_ids"  # INT32 [-1]: new tokens of one decode response
# BYTES [1], optional: JSON [TokenLogprob.to_json(), ...], one per token of a prefill or
# decode response whose request asks for logprobs
TOKEN_LOGPROBS = "token_logprobs"
WORKER_PID = "worker_pid"  # INT32 [1]: the process that produced a response
# INT32 [4]: a decode engine's sequences running and waiting, its free slots and free KV
# cache (in tokens), with each response to a caller that asks for it (a frontend choosing
# among decode replicas)
DECODE_LOAD = "decode_load"
PREFILL_PID = "prefill_pid"  # INT32 [1]: orchestrator's final response (0: no prefill pool)
DECODE_PID = "decode_pid"  # INT32 [1]
KV_BYTES = "kv_bytes"  # INT64 [1]: orchestrator's final response
KV_HANDOFF_US = "kv_handoff_us"  # INT64 [1]
# INT32 [1]: prompt tokens whose K/V came from a prefix cache (OpenAI usage cached_tokens);
# on prefill's response, decode's first token, and the final reply of orchestrator and router
NUM_CACHED_TOKENS = "num_cached_tokens"
SERVED_BY = "served_by"  # BYTES [1]: "disaggregated" | "colocated" | "fallback" | endpoint
# ------------------------------------------------------------------ router's final response
ROUTE_TARGET = "route_target"  # BYTES [1]: the policy target that served the request
ROUTE_REASON = "route_reason"  # BYTES [1]: rule name, "default", or why it fell back
ERROR = "error"  # BYTES [1]: with finish_reason "error": what failed after text was sent
# BYTES [1]: JSON list of OpenAI tool-call deltas ({index, id, type, function: {name,
# arguments}}) an endpoint answered with, relayed as they came (a whole reply: one per call)
OUTPUT_TOOL_CALLS = "output_tool_calls"

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
# A client of an entry model over gRPC (the gateway) asks for the acknowledgement alone: a
# first response with WORKER_PID, whose process it watches (Triton 2.51 never ends the
# requests of a stub that died: they stay open for good); failures stay Triton errors.
ACK_PARAM = "disagg_ack"  # request parameter; true
# every request parameter our models read: an entry model refuses any other (a generate
# field that is no input of the model arrives as a parameter; codec.tensors.check_parameters)
REQUEST_PARAMETERS = (CALLER_PARAM, TOKEN_PARAM, CALLER_PID_PARAM, ACK_PARAM)
TOKEN_ENV = "DISAGG_INTERNAL_TOKEN"
ERROR_KIND = "error_kind"  # BYTES [1]: "" on success


class ErrorKind(enum.StrEnum):
    """The kind of a failure, as it travels between models (ERROR_KIND, the tag of an error
    message) and in metric labels; errors.py's layers map onto it in `error_kind_of`."""

    INVALID_REQUEST = "invalid_request"  # the client's: retrying it unchanged cannot succeed
    UNAVAILABLE = "unavailable"  # busy, or a pool down: route around it, retry later
    INTERNAL = "internal"  # a bug, or Triton's own error
    # decode lacks the prefix a partial KV hand-off left out: hand the whole prompt off again
    PREFIX_MISS = "prefix_miss"
    # the hand-off's payload could not be pulled or was damaged: decode prefills it instead
    KV_TRANSFER = "kv_transfer"


INVALID_REQUEST, UNAVAILABLE, INTERNAL, PREFIX_MISS = (
    ErrorKind.INVALID_REQUEST, ErrorKind.UNAVAILABLE, ErrorKind.INTERNAL, ErrorKind.PREFIX_MISS,
)  # fmt: skip
ERROR_KINDS = tuple(ErrorKind)

FINISH_ERROR = "error"  # finish_reason: a stage failed after part of the answer was sent

# ------------------------------------------------------------------ serving modes
DISAGGREGATED = "disaggregated"  # prefill pool -> KV hand-off -> decode pool
COLOCATED = "colocated"  # decode prefills too
CONDITIONAL = "conditional"  # per request, by the cost model (pipeline/conditional.py)
FALLBACK = "fallback"  # served_by only: disaggregated, but prefill failed and decode prefilled
MODES = (DISAGGREGATED, COLOCATED, CONDITIONAL)

# ------------------------------------------------------------------ admin credentials
ADMIN_HEADER = "admin-key"  # Triton's restricted APIs and the gateway's /admin routes
ADMIN_KEY_ENV = "DISAGG_ADMIN_KEY"
REQUEST_ID_HEADER = "x-request-id"  # the gateway's; becomes the router's request id


def internal_token() -> str:
    """This server's internal token ("" when unset): the one place it is read."""
    return os.environ.get(TOKEN_ENV, "")


def error_kind_of(exc: BaseException) -> ErrorKind:
    """The kind of a failure, as it travels between models and in metric labels."""
    if isinstance(exc, RequestError):
        return INVALID_REQUEST
    if isinstance(exc, KVPrefixMissError):  # (a PoolError: a caller that knows no better fails)
        return PREFIX_MISS
    if isinstance(exc, KVPayloadError):  # (a PoolError too)
        return ErrorKind.KV_TRANSFER
    if isinstance(exc, (CapacityError, PoolError, EngineDeadError)):
        return UNAVAILABLE
    return INTERNAL


def error_from_kind(kind: str, message: str, where: str) -> DisaggError:
    """The exception a caller raises for a failure a model behind it reported: a bad request
    stays the client's error; anything else is the pool's, so the caller may route around it."""
    if kind == INVALID_REQUEST:
        return RequestError(message)
    if kind == PREFIX_MISS:
        return KVPrefixMissError(f"{where}: {message}")
    if kind == ErrorKind.KV_TRANSFER:
        return KVPayloadError(f"{where}: {message}")
    return PoolError(f"{where}: {message}")


def sampling_to_json(params: SamplingParams) -> str:
    return json.dumps(asdict(params))


def sampling_from_json(text: str) -> SamplingParams:
    try:
        data = json.loads(text)
        data["stop_token_ids"] = tuple(data.get("stop_token_ids", ()))
        data["stop"] = tuple(data.get("stop", ()))
        data["bad_words_ids"] = tuple(tuple(w) for w in data.get("bad_words_ids", ()))
        data["logit_bias"] = tuple((t, b) for t, b in data.get("logit_bias", ()))
        data["guide_tokens"] = tuple(data.get("guide_tokens", ()))
        return SamplingParams(**data)
    except (ValueError, TypeError) as e:
        raise RequestError(f"malformed sampling parameters: {e}") from e


# ------------------------------------------------------------------ how an error's kind travels
# Between models, a failure is an error response with a Triton code (INVALID_ARG for
# invalid_request, UNAVAILABLE, INTERNAL) or, inside a BLS stream, ERROR_KIND/ERROR outputs.
# A gRPC stream carries an error's message but not its code, so the message starts with the
# kind's tag: `[invalid_request] prompt is empty`. `split_error` reads it back.
_TAG = re.compile(r"\[(" + "|".join(ERROR_KINDS) + r")\] ")


def tag_error(kind: str, message: str) -> str:
    """The message as it leaves a model: tagged with its kind once (a model behind us may
    have tagged it already)."""
    return message if _TAG.search(message) else f"[{kind}] {message}"


def split_error(message: str) -> tuple[ErrorKind, str]:
    """(kind, message without the tag) of an error message from a model; INTERNAL when
    untagged (Triton's own errors). Triton may put words of its own before a model's
    message (`in ensemble 'x', ...`), so the tag is looked for anywhere."""
    m = _TAG.search(message)
    if m is None:
        return INTERNAL, message
    return ErrorKind(m.group(1)), message[m.end() :]


# ------------------------------------------------------------------ request ids
# One scheme from the gateway to decode. A client's id (the gateway's x-request-id, a Triton
# request id) is kept when safe, so logs are greppable by it; each stage that starts work of
# its own extends its caller's id with a dot: `client-1f2e...` (router) ->
# `client-1f2e....9a8b...` (orchestrator). Cancelling an id cancels every id that extends it
# (cancel.py), so a caller that knows only its own id reaches decode.
SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_UNSAFE_CLIENT_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def client_request_id(given: str) -> str:
    """A client's id, reduced to safe characters (at most 64); "" when nothing is left."""
    return _UNSAFE_CLIENT_CHARS.sub("", given or "")[:64]


def new_request_id(client_id: str = "") -> str:
    """The first stage's id: unique, and starting with the client's id when it sent one."""
    safe = client_request_id(client_id)
    return f"{safe}-{uuid.uuid4().hex[:16]}" if safe else uuid.uuid4().hex


def child_request_id(caller_id: str) -> str:
    """A later stage's id: unique, extending the caller's (when it is safe and short enough)
    so that cancelling the caller's id cancels this one too."""
    suffix = uuid.uuid4().hex
    if caller_id and len(caller_id) <= 96 and SAFE_REQUEST_ID.match(caller_id):
        return f"{caller_id}.{suffix[:12]}"
    return suffix


# ------------------------------------------------------------------ boundary types


@dataclass(frozen=True)
class Handoff:
    """What the prefill pool returns: the first token and the KV payload, still as bytes
    (the decode pool parses and verifies it; the orchestrator only forwards it)."""

    first_token: int
    seed: int
    kv_payload: npt.NDArray[np.uint8]  # [n]: KVPayload.to_bytes()
    worker_pid: int
    prefill_time_s: float  # compute only, as measured by the prefill worker
    start_wall_s: float = 0.0  # time.time() when its compute began (0: not reported)
    call_time_s: float = 0.0  # the whole prefill call, as the orchestrator saw it
    queue_s: float = 0.0  # sent -> compute began (same host's clock; 0 when not reported)
    num_cached_tokens: int = 0  # leading prompt tokens the prefill pool's prefix cache gave
    # leading prompt tokens the payload leaves out (decode's prefix cache holds them); 0: the
    # whole prompt's K/V
    kv_start: int = 0
    first_logprob: TokenLogprob | None = None  # when the request asks for logprobs


@dataclass(frozen=True)
class DecodeStep:
    """One response of the decode pool."""

    token_ids: list[int]
    finish_reason: str | None  # set on the last response
    worker_pid: int
    num_cached_tokens: int = 0  # with the first token decode prefilled: its prefix cache's
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks


@dataclass(frozen=True)
class DecodeStats:
    """A decode engine's state after a step (metrics); None: this engine does not know it."""

    num_running: int
    num_waiting: int
    num_steps: int | None = None
    num_kv_blocks_used: int | None = None
    num_kv_blocks_total: int | None = None
    kv_bytes_reserved: int | None = None
    kv_bytes_capacity: int | None = None
    prefix_cache: PrefixCacheStats | None = None  # a copy; None: no prefix cache


@dataclass
class Reply:
    """One response of the local pipeline: a delta while streaming, the whole reply otherwise."""

    text: str
    num_input_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None  # set on the final reply only
    served_by: str = ""
    prefill_pid: int = 0
    decode_pid: int = 0
    token_ids: list[int] = field(default_factory=list)
    kv_bytes: int = 0  # KV hand-off bytes that passed the orchestrator (a reference's: kvshm)
    kv_handoff_s: float = 0.0  # moving it: serialise + transfer + verify + import
    num_cached_tokens: int = 0  # final: prompt tokens a prefix cache gave (not recomputed)
    # when the request asks: this response's tokens as OpenAI's logprobs objects (token,
    # logprob, bytes, top_logprobs), all of the reply's on a whole reply
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class RoutedReply:
    """One response of the router: a delta while streaming, or the final reply."""

    text: str
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    target: str = ""  # final: the policy target that served it
    reason: str = ""  # final: why (rule name, "default", or what made it fall back)
    served_by: str = ""  # final: endpoint name, or the local pipeline's own served_by
    error: str = ""  # final, with finish_reason FINISH_ERROR: what failed
    num_cached_tokens: int = 0  # final: prompt tokens a prefix cache gave
    logprobs: list[dict[str, Any]] | None = None  # as Reply's
    tool_calls: list[dict[str, Any]] | None = None  # OUTPUT_TOOL_CALLS: an endpoint's calls
