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
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import triton_python_backend_utils as pb_utils

from disagg import contracts as C
from disagg.codec import tensors as codec
from disagg.codec.generate import OrchestratorReply, RouterReply
from disagg.contracts import Reply, RoutedReply
from disagg.errors import PoolError, RequestError
from disagg.model_params import ModelParams

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_log = logging.getLogger("disagg.triton")


def model_parameters(args: dict[str, str]) -> ModelParams:
    """The `parameters` of a model's config.pbtxt, typed as the settings they come from."""
    config = json.loads(args["model_config"])
    raw = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    return ModelParams(raw, args.get("model_name", "model"))


def set_torch_threads(threads: int) -> None:
    """Threads for this model process; 0 keeps torch's default (all cores)."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def set_nice(nice: int) -> None:
    """Lower this process's CPU priority to `nice` (0: leave it). On Linux niceness is
    per thread: every thread the stub has is set, and the threads made later (torch's
    OpenMP pool, on the first parallel region) inherit it from the thread that makes them."""
    if nice <= 0:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except (ProcessLookupError, PermissionError):  # (a thread that ended meanwhile)
            continue


def is_decoupled(args: dict[str, str]) -> bool:
    return pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))


# ------------------------------------------------------------------ reading requests


def request_parameters(request: pb_utils.InferenceRequest) -> dict[str, Any]:  # JSON values
    try:
        params = json.loads(request.parameters() or "{}")
    except (ValueError, TypeError):
        return {}
    return params if isinstance(params, dict) else {}


def client_inputs(
    request: pb_utils.InferenceRequest, message: codec.Tensors, model: str
) -> codec.Arrays:
    """An entry model's inputs among `message`'s, once its parameters are known to be ours
    alone (codec.tensors.check_parameters: a generate field that is no input arrives as one)."""
    codec.check_parameters(request_parameters(request), message, model)
    return input_arrays(request, message.names)


def input_array(request: pb_utils.InferenceRequest, name: str) -> codec.Array | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def input_arrays(request: pb_utils.InferenceRequest, names: Iterable[str]) -> codec.Arrays:
    """The request's inputs among `names` (a codec message's), absent ones left out."""
    return codec.gather(lambda name: input_array(request, name), names)


def read_fields(
    request: pb_utils.InferenceRequest, kinds: dict[str, str], batched: bool
) -> dict[str, Any]:
    """Present inputs among `kinds` ({name: "str" | "strs" | "int" | "float" | "bool" |
    "ints"}) as plain Python values (codec.tensors.read_fields). Absent optional inputs are
    simply left out."""
    return codec.read_fields(input_arrays(request, kinds), kinds, batched)


# ------------------------------------------------------------------ responses


def tensor(
    name: str, value: npt.ArrayLike, dtype: npt.DTypeLike, batched: bool = False
) -> pb_utils.Tensor:
    arr = np.asarray(value, dtype=dtype)
    arr = arr.reshape(-1)
    return pb_utils.Tensor(name, arr[None, :] if batched else arr)


def tensors(arrays: codec.Arrays) -> list[pb_utils.Tensor]:
    """A codec message's arrays as Triton tensors."""
    return [pb_utils.Tensor(name, arr) for name, arr in arrays.items()]


def requested_outputs(request: pb_utils.InferenceRequest) -> frozenset[str]:
    return frozenset(request.requested_output_names())


def response(
    outputs: list[pb_utils.Tensor], requested: frozenset[str] = frozenset()
) -> pb_utils.InferenceResponse:
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
    """An orchestrator response (codec.generate.OrchestratorReply)."""
    return response(tensors(OrchestratorReply.encode(reply, batched)), requested)


def error_code(exc: Exception) -> int:
    # looked up per call: the stub that auto-completes configs has no TritonError
    codes = pb_utils.TritonError
    kind = C.error_kind_of(exc)
    if kind is C.ErrorKind.INVALID_REQUEST:
        return codes.INVALID_ARG
    if kind in (C.ErrorKind.UNAVAILABLE, C.ErrorKind.PREFIX_MISS, C.ErrorKind.KV_TRANSFER):
        return codes.UNAVAILABLE
    return codes.INTERNAL


def error_response(exc: Exception) -> pb_utils.InferenceResponse:
    """A Triton error with the kind's code, its message tagged with the kind (a gRPC stream
    carries the message alone; contracts.split_error reads the kind back)."""
    message = C.tag_error(C.error_kind_of(exc), str(exc))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, error_code(exc)))


def raise_for_error(response: pb_utils.InferenceResponse, what: str) -> None:
    """Every BLS sub-response is checked: a client error stays a client error, anything else
    becomes a PoolError the orchestrator can route around."""
    if not response.has_error():
        return
    err = response.error()
    assert err is not None, "has_error() says there is one"
    kind, message = C.split_error(err.message())
    if err.code() == pb_utils.TritonError.INVALID_ARG:
        raise RequestError(message)
    if kind is C.ErrorKind.PREFIX_MISS:  # the caller resends the whole prompt's K/V
        raise C.error_from_kind(kind, message, what)
    raise PoolError(f"{what}: {err.message()}")


def output_array(response: pb_utils.InferenceResponse, name: str) -> codec.Array | None:
    t = pb_utils.get_output_tensor_by_name(response, name)
    return None if t is None else t.as_numpy()


def output_arrays(response: pb_utils.InferenceResponse, names: Iterable[str]) -> codec.Arrays:
    """The response's outputs among `names` (a codec message's), absent ones left out."""
    return codec.gather(lambda name: output_array(response, name), names)


def routed_response(
    reply: RoutedReply, batched: bool, requested: frozenset[str] = frozenset()
) -> pb_utils.InferenceResponse:
    """A router response (codec.generate.RouterReply): the ensemble's outputs, and on the
    final one where it was routed."""
    return response(tensors(RouterReply.encode(reply, batched)), requested)


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
