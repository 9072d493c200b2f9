"""Triton adapter basics: model parameters, request tensors -> plain values, responses, and
disagg's error layers mapped onto Triton error codes. With bls.py (calls between models),
pb_metrics.py (metrics) and runner.py (how entry models serve requests), the only modules
that know triton_python_backend_utils; imported only inside a Python backend stub.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg import contracts as P
from disagg.contracts import Reply
from disagg.errors import PoolError, RequestError
from disagg.settings import ModelParams

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_log = logging.getLogger("disagg.triton")


def model_parameters(args: dict) -> ModelParams:
    """The `parameters` of a model's config.pbtxt, typed as the settings they come from."""
    config = json.loads(args["model_config"])
    raw = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    return ModelParams(raw, args.get("model_name", "model"))


def set_torch_threads(threads: int) -> None:
    """Threads for this model process; 0 keeps torch's default (all cores)."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def is_decoupled(args: dict) -> bool:
    return pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))


# ------------------------------------------------------------------ reading requests


def input_array(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _one_item(name: str, arr: np.ndarray, batched: bool) -> np.ndarray:
    """Drop the batch dimension of a batched model's input, refusing batches above 1."""
    if batched:
        if arr.ndim == 0 or arr.shape[0] != 1:
            raise RequestError(f"{name}: batch size must be 1 (send one prompt per request)")
        arr = arr[0]
    return arr.reshape(-1)


def _text(value) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"text is not valid UTF-8: {e}") from e
    return str(value)


def read_fields(request, kinds: dict[str, str], batched: bool) -> dict:
    """Present inputs among `kinds` ({name: "str" | "strs" | "int" | "float" | "bool" |
    "ints"}) as plain Python values. Absent optional inputs are simply left out."""
    fields = {}
    for name, kind in kinds.items():
        arr = input_array(request, name)
        if arr is None:
            continue
        flat = _one_item(name, arr, batched)
        if kind == "strs":
            fields[name] = [_text(v) for v in flat]
        elif kind == "ints":
            fields[name] = [int(v) for v in flat]
        elif flat.size != 1:
            raise RequestError(f"{name} must hold exactly one value, got {flat.size}")
        elif kind == "str":
            fields[name] = _text(flat[0])
        elif kind == "int":
            fields[name] = int(flat[0])
        elif kind == "float":
            fields[name] = float(flat[0])
        elif kind == "bool":
            fields[name] = bool(flat[0])
    return fields


# ------------------------------------------------------------------ responses


def tensor(name: str, value, dtype, batched: bool = False) -> pb_utils.Tensor:
    arr = np.asarray(value, dtype=dtype)
    arr = arr.reshape(-1)
    return pb_utils.Tensor(name, arr[None, :] if batched else arr)


def _client_outputs(reply, batched: bool) -> list[pb_utils.Tensor]:
    """The ensemble's four outputs, from a Reply or a RoutedReply."""
    return [
        tensor(P.TEXT_OUTPUT, [reply.text.encode("utf-8")], np.object_, batched),
        tensor(P.NUM_INPUT_TOKENS, [reply.num_input_tokens], np.int32, batched),
        tensor(P.NUM_OUTPUT_TOKENS, [reply.num_output_tokens], np.int32, batched),
        tensor(P.FINISH_REASON, [(reply.finish_reason or "").encode()], np.object_, batched),
    ]


def requested_outputs(request) -> frozenset[str]:
    return frozenset(request.requested_output_names())


def response(outputs: list, requested: frozenset[str] = frozenset()):
    """A response holding only the outputs the requester asked for (all when `requested` is
    empty). Triton 2.51's response sender drops the others itself, with the GIL released,
    and freeing their numpy arrays without the GIL corrupts CPython's allocator: the stub
    crashed in libpython after minutes of streaming (python_backend fixed ~PbTensor to take
    the GIL in Dec 2024, after 2.51)."""
    if requested:
        outputs = [t for t in outputs if t.name() in requested]
    return pb_utils.InferenceResponse(output_tensors=outputs)


def reply_response(
    reply: Reply, batched: bool, requested: frozenset[str] = frozenset()
) -> pb_utils.InferenceResponse:
    outputs = _client_outputs(reply, batched)
    if reply.finish_reason is not None:
        outputs += [
            tensor(P.SERVED_BY, [reply.served_by.encode()], np.object_, batched),
            tensor(P.PREFILL_PID, [reply.prefill_pid], np.int32, batched),
            tensor(P.DECODE_PID, [reply.decode_pid], np.int32, batched),
            tensor(P.KV_BYTES, [reply.kv_bytes], np.int64, batched),
            tensor(P.KV_HANDOFF_US, [int(reply.kv_handoff_s * 1e6)], np.int64, batched),
        ]
    return response(outputs, requested)


def error_code(exc: Exception):
    # looked up per call: the stub that auto-completes configs has no TritonError
    codes = pb_utils.TritonError
    kind = P.error_kind_of(exc)
    if kind == P.INVALID_REQUEST:
        return codes.INVALID_ARG
    return codes.UNAVAILABLE if kind == P.UNAVAILABLE else codes.INTERNAL


def error_response(exc: Exception) -> pb_utils.InferenceResponse:
    """A Triton error with the kind's code, its message tagged with the kind (a gRPC stream
    carries the message alone; contracts.split_error reads the kind back)."""
    message = P.tag_error(P.error_kind_of(exc), str(exc))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, error_code(exc)))


def raise_for_error(response, what: str) -> None:
    """Every BLS sub-response is checked: a client error stays a client error, anything else
    becomes a PoolError the orchestrator can route around."""
    if not response.has_error():
        return
    err = response.error()
    if err.code() == pb_utils.TritonError.INVALID_ARG:
        raise RequestError(P.split_error(err.message())[1])
    raise PoolError(f"{what}: {err.message()}")


def output_array(response, name: str) -> np.ndarray:
    t = pb_utils.get_output_tensor_by_name(response, name)
    if t is None:
        raise PoolError(f"response lacks output {name!r}")
    return t.as_numpy()


def routed_response(
    reply, batched: bool, requested: frozenset[str] = frozenset()
) -> pb_utils.InferenceResponse:
    """A router response: the ensemble's outputs, and on the final one where it was routed."""
    outputs = _client_outputs(reply, batched)
    if reply.finish_reason is not None:
        for name, value in (
            (P.ROUTE_TARGET, reply.target),
            (P.ROUTE_REASON, reply.reason),
            (P.SERVED_BY, reply.served_by),
            (P.ERROR, reply.error),
        ):
            outputs.append(tensor(name, [value.encode("utf-8")], np.object_, batched))
    return response(outputs, requested)


def configure_logging() -> None:
    """disagg's own log lines (routing decisions, fallbacks) in the tritonserver log: the stub
    inherits the server's stderr. Level from DISAGG_LOG_LEVEL (default INFO)."""
    import logging

    # a crash of the stub (SIGSEGV, SIGABRT) prints every thread's Python stack to the log
    faulthandler.enable(all_threads=True)
    logger = logging.getLogger("disagg")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("DISAGG_LOG_LEVEL", "INFO").upper())
    logger.propagate = False
