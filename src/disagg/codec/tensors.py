"""The pieces every message is made of: a tensor's declaration (`TensorSpec`), a message's
tensors (`Tensors`), reading request inputs into plain values, and the two small messages
every BLS callee may send: its acknowledgement and a failure as outputs (contracts.py,
"failures inside a BLS stream")."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from disagg import contracts as C
from disagg.errors import PoolError, RequestError

Array = NDArray[Any]
Arrays = dict[str, Array]  # one message: tensor name -> array

# numpy dtype -> Triton's name for it on the wire; config.pbtxt spells it TYPE_<name>, except
# BYTES, which it calls TYPE_STRING
_TRITON_DTYPES = {
    np.dtype(np.object_): "BYTES",
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.float32): "FP32",
}


def triton_dtype(dtype: np.dtype[Any] | type) -> str:
    """Triton's name of a numpy dtype ("BYTES" for object arrays of UTF-8 bytes)."""
    return _TRITON_DTYPES[np.dtype(dtype)]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a message, as its model's config.pbtxt declares it."""

    name: str  # a contracts.py constant
    dtype: type  # numpy scalar type; np.object_ holds UTF-8 bytes (Triton's BYTES)
    dims: tuple[int, ...] = (1,)  # per request, without the batch dimension; -1: any length
    optional: bool = False  # an input its caller may leave out

    @property
    def triton_dtype(self) -> str:
        return triton_dtype(self.dtype)

    @property
    def kind(self) -> str:
        """How `read_fields` turns this input into a Python value."""
        many = self.dims != (1,)
        if self.dtype is np.object_:
            return "strs" if many else "str"
        if self.dtype is np.bool_:
            return "bool"
        if np.issubdtype(self.dtype, np.floating):
            return "float"
        return "ints" if many else "int"

    def array(self, value: Any, batched: bool = False) -> Array:
        """`value` (one value or a sequence of them; text as str or bytes) as this tensor:
        [n], or [1, n] for a model with a batch dimension; [1, n] / [1, 1, n] for dims of
        two."""
        if self.dtype is np.object_:
            items = [value] if isinstance(value, str | bytes) else list(value)
            value = [v.encode("utf-8") if isinstance(v, str) else v for v in items]
        arr: Array = np.asarray(value, dtype=self.dtype).reshape(-1)
        if len(self.dims) > 1:  # [-1, -1] (beams x tokens): one beam
            arr = arr.reshape((1,) * (len(self.dims) - 1) + (-1,))
        return arr[None] if batched else arr


@dataclass(frozen=True)
class Tensors:
    """The tensors of one message, in the order its config declares them."""

    specs: tuple[TensorSpec, ...]

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.specs)

    def __add__(self, other: Tensors) -> Tensors:
        return Tensors(self.specs + other.specs)

    def without(self, other: Tensors) -> Tensors:
        return Tensors(tuple(s for s in self.specs if s.name not in other.names))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def kinds(self) -> dict[str, str]:
        return {s.name: s.kind for s in self.specs}

    def encode(self, values: Mapping[str, object], batched: bool = False) -> Arrays:
        """Each of `values` (name -> value) as its tensor. A name that is not one of this
        message's is a bug of the caller (KeyError)."""
        by_name = {s.name: s for s in self.specs}
        return {name: by_name[name].array(value, batched) for name, value in values.items()}

    def read(self, arrays: Mapping[str, Array], batched: bool) -> dict[str, Any]:
        """The inputs present in `arrays` as plain values (see `read_fields`)."""
        return read_fields(arrays, self.kinds, batched)


def gather(get: Callable[[str], Array | None], names: Iterable[str]) -> Arrays:
    """The arrays `get` has for `names` (a request's inputs, a response's outputs, a
    tritonclient result's `as_numpy`), absent ones left out."""
    return {name: arr for name in names if (arr := get(name)) is not None}


# ------------------------------------------------------------------ reading inputs


def _one_item(name: str, arr: Array, batched: bool) -> Array:
    """Drop the batch dimension of a batched model's input, refusing batches above 1."""
    if batched:
        if arr.ndim == 0 or arr.shape[0] != 1:
            raise RequestError(f"{name}: batch size must be 1 (send one prompt per request)")
        arr = arr[0]
    return arr.reshape(-1)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"text is not valid UTF-8: {e}") from e
    return str(value)


def read_fields(
    arrays: Mapping[str, Array], kinds: Mapping[str, str], batched: bool
) -> dict[str, Any]:
    """Present inputs among `kinds` ({name: "str" | "strs" | "int" | "float" | "bool" |
    "ints"}) as plain Python values. Absent optional inputs are simply left out."""
    fields: dict[str, Any] = {}
    for name, kind in kinds.items():
        arr = arrays.get(name)
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


def check_parameters(parameters: Iterable[str], message: Tensors, model: str) -> None:
    """Refuse a client request to an entry model whose parameters are not all disagg's own
    (contracts.REQUEST_PARAMETERS), naming them. Triton's generate endpoint passes a JSON
    field that is no input of the model, at the top level or under "parameters", on as a
    request parameter (server v2.51 src/http_server.cc, `ExactMappingInput`), so a misspelt
    or unsupported input ("max_token", "top_n") was dropped silently and the request served
    without it. (An unknown *tensor* of an infer call never gets here: Triton refuses it,
    "unexpected inference input".)"""
    unknown = sorted(set(parameters) - set(C.REQUEST_PARAMETERS))
    if unknown:  # a client's names: a few, each cut short, repr'd (no newline in a log)
        names = ", ".join(repr(name[:64]) for name in unknown[:5])
        raise RequestError(
            f"unknown input {names} for model '{model}' (a field of the request that is no "
            f"input of the model); its inputs are: {', '.join(message.names)}"
        )


# ------------------------------------------------------------------ reading outputs


def required(arrays: Mapping[str, Array], name: str) -> Array:
    """An output a pool's answer must carry, flattened."""
    arr = arrays.get(name)
    if arr is None:
        raise PoolError(f"response lacks output {name!r}")
    return arr.reshape(-1)


def scalar(arr: Array | None) -> str | int | None:
    """One scalar output (text decoded), or None when absent."""
    if arr is None:
        return None
    flat = arr.reshape(-1)
    if flat.dtype == np.object_:
        return flat[0].decode("utf-8") if flat.size else ""
    return int(flat[0])


# ------------------------------------------------------------------ every BLS callee's


ACK = Tensors((TensorSpec(C.WORKER_PID, np.int32),))  # the first response to a BLS caller
FAILURE = Tensors((TensorSpec(C.ERROR_KIND, np.object_), TensorSpec(C.ERROR, np.object_)))


def encode_ack(pid: int, batched: bool = False) -> Arrays:
    """Which process the caller watches while it waits."""
    return ACK.encode({C.WORKER_PID: pid}, batched)


def encode_failure(exc: BaseException, batched: bool = False) -> Arrays:
    """A failure as the outputs of an ordinary final response."""
    message = str(exc).encode("utf-8", "replace")
    return FAILURE.encode({C.ERROR_KIND: C.error_kind_of(exc).value, C.ERROR: message}, batched)


def raise_for_failure(arrays: Mapping[str, Array], what: str) -> None:
    """A failure a model behind us sent as outputs (`encode_failure`), raised as ours."""
    kind = arrays.get(C.ERROR_KIND)
    if kind is None or not (k := kind.reshape(-1)[0].decode()):
        return
    message = arrays.get(C.ERROR)
    text = "" if message is None else message.reshape(-1)[0].decode("utf-8", "replace")
    raise C.error_from_kind(k, text or "failed", what)
