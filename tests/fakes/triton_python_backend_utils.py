"""A stand-in for the Python backend's `triton_python_backend_utils`, for unit tests of
disagg.triton's adapters outside a stub. It holds what they use, with the real module's
names and behaviour where it matters (tensors are numpy arrays, responses carry an error or
outputs, requests carry JSON parameters); BLS calls return what a test scripts."""

from __future__ import annotations

import json

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonModelException(Exception):
    pass


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE = 0, 1, 2, 3, 4

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, array) -> None:
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors=None, error: TritonError | None = None, parameters=None):
        self._outputs = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class ResponseSender:
    """Records what a model sends: (response, flags) pairs."""

    def __init__(self) -> None:
        self.sent: list[tuple[InferenceResponse, int]] = []
        self.cancelled = False

    def send(self, response=None, flags: int = 0) -> None:
        if self.sent and self.sent[-1][1] & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            raise AssertionError("a response after the final one (crashes Triton 2.51)")
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return self.cancelled


class InferenceRequest:
    """A request: one a model sends over BLS (`exec` answers with what the test put in
    `InferenceRequest.script`), or one a test hands to a model's execute()."""

    script: list = []  # responses (or an exception) the next exec() yields
    last: InferenceRequest | None = None  # the last one exec() was called on

    def __init__(self, model_name="", inputs=None, requested_output_names=None, **kw) -> None:
        self.model_name = model_name
        self.inputs = inputs or []
        self._requested = list(requested_output_names or [])
        self._parameters = kw.get("parameters") or {}
        self._request_id = kw.get("request_id", "")
        self.timeout = kw.get("timeout")
        self.sender = ResponseSender()
        self.cancelled = False  # set by a test: Triton cancelled it (a gRPC call cancelled)

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def request_id(self) -> str:
        return self._request_id

    def requested_output_names(self) -> list[str]:
        return self._requested

    def get_response_sender(self) -> ResponseSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.cancelled

    def exec(self, decoupled: bool = False):
        type(self).last = self
        script = type(self).script
        if isinstance(script, Exception):
            raise script
        if callable(script):  # e.g. a call that never returns
            return script()
        return iter(script) if decoupled else script[0]


def _by_name(tensors, name: str):
    return next((t for t in tensors if t.name() == name), None)


def get_input_tensor_by_name(request, name: str):
    return _by_name(request.inputs, name)


def get_output_tensor_by_name(response, name: str):
    return _by_name(response.output_tensors(), name)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class _Series:
    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, value: float) -> None:
        self.value += value

    def observe(self, value: float) -> None:
        self.value = value


class MetricFamily:
    """Like Triton's: one registry per server, and a series asked for again with the same
    family name and labels is the same series (so it outlives the process that made it)."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    registry: dict[tuple, _Series] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind = name, kind

    def Metric(self, labels=None, buckets=None) -> _Series:  # noqa: N802 (the real name)
        key = (self.name, tuple(sorted((labels or {}).items())))
        return type(self).registry.setdefault(key, _Series())
