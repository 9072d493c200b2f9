"""The one module of disagg that knows triton_python_backend_utils.

Reading request tensors into plain values, building responses, mapping disagg's error layers
onto Triton error codes, and the BLS implementations of the orchestrator's pool interfaces.
Imported only inside a Triton Python backend stub (where the module exists).
"""

from __future__ import annotations

import gc
import hmac
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg import metrics as M
from disagg.cancel import CancelRegistry
from disagg.config import EngineConfig
from disagg.errors import (
    KVPayloadError,
    PoolError,
    RequestError,
)
from disagg.sequence import SamplingParams
from disagg.triton import protocol as P
from disagg.triton.orchestrator import DecodeStep, Handoff, Reply

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_log = logging.getLogger("disagg.triton")


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of a model's config.pbtxt, as strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def engine_config(p: dict[str, str]) -> EngineConfig:
    """The EngineConfig a model's parameters describe (max_num_seqs only for decode, whose
    KV cache is then touched at start: steady-state speed from the first request)."""
    extra = (
        {"max_num_seqs": int(p["max_num_seqs"]), "prefault_kv": True}
        if ("max_num_seqs" in p)
        else {}
    )
    return EngineConfig(
        max_model_len=int(p["max_model_len"]), max_tokens_limit=int(p["max_tokens_limit"]), **extra
    )


def set_torch_threads(p: dict[str, str]) -> None:
    """Threads for this model process; 0 or absent keeps torch's default (all cores)."""
    import torch

    if int(p.get("torch_threads", "0")) > 0:
        torch.set_num_threads(int(p["torch_threads"]))


def is_decoupled(args: dict) -> bool:
    return pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))


# ------------------------------------------------------------------ reading requests


def _array(request, name: str) -> np.ndarray | None:
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
        arr = _array(request, name)
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


def reply_response(reply: Reply, batched: bool) -> pb_utils.InferenceResponse:
    outputs = _client_outputs(reply, batched)
    if reply.finish_reason is not None:
        outputs += [
            tensor(P.SERVED_BY, [reply.served_by.encode()], np.object_, batched),
            tensor(P.PREFILL_PID, [reply.prefill_pid], np.int32, batched),
            tensor(P.DECODE_PID, [reply.decode_pid], np.int32, batched),
            tensor(P.KV_BYTES, [reply.kv_bytes], np.int64, batched),
            tensor(P.KV_HANDOFF_US, [int(reply.kv_handoff_s * 1e6)], np.int64, batched),
        ]
    return pb_utils.InferenceResponse(output_tensors=outputs)


def error_code(exc: Exception):
    # looked up per call: the stub that auto-completes configs has no TritonError
    codes = pb_utils.TritonError
    kind = P.error_kind_of(exc)
    if kind == P.INVALID_REQUEST:
        return codes.INVALID_ARG
    return codes.UNAVAILABLE if kind == P.UNAVAILABLE else codes.INTERNAL


def error_kind(exc: Exception) -> str:
    """A metric label for an error: invalid_request, unavailable or internal."""
    return P.error_kind_of(exc)


def _request_parameters(request) -> dict:
    try:
        params = json.loads(request.parameters() or "{}")
    except (ValueError, TypeError):
        return {}
    return params if isinstance(params, dict) else {}


def is_bls_caller(request) -> bool:
    """Whether another model of this server sent `request` over BLS (see protocol.py)."""
    return _request_parameters(request).get(P.CALLER_PARAM) == P.BLS_CALLER


def check_internal(request, model: str) -> None:
    """Refuse a request to an internal model that did not come from this server's own BLS
    calls (it carries this server's token; see protocol.py)."""
    token = os.environ.get(P.TOKEN_ENV, "")
    given = str(_request_parameters(request).get(P.TOKEN_PARAM, ""))
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise RequestError(
            f"'{model}' is internal to this server's pipeline and takes no requests from "
            "clients: send them to 'router' (or 'ensemble'), or to the gateway"
        )


# what a BLS call sends (is_bls_caller, check_internal, CallerWatch)
BLS_PARAMETERS = {
    P.CALLER_PARAM: P.BLS_CALLER,
    P.TOKEN_PARAM: os.environ.get(P.TOKEN_ENV, ""),
    P.CALLER_PID_PARAM: os.getpid(),
}


class CallerWatch:
    """Whether the model process that sent a BLS request has died (protocol.py,
    CALLER_PID_PARAM); pid 0 watches nothing. Asked before every send (a send to a caller
    that died can block for good), so it reads /proc every time by default (~10 us)."""

    def __init__(self, pid: int, interval_s: float = 0.0) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self._next = 0.0
        self._gone = False

    @classmethod
    def of(cls, request) -> CallerWatch:
        try:
            pid = int(_request_parameters(request).get(P.CALLER_PID_PARAM, 0))
        except (TypeError, ValueError):
            pid = 0
        return cls(pid if is_bls_caller(request) else 0)

    def gone(self) -> bool:
        if self.pid and not self._gone:
            now = time.monotonic()
            if now >= self._next:
                self._next = now + self.interval_s
                self._gone = not process_alive(self.pid)
        return self._gone


def ack_response(pid: int, batched: bool) -> pb_utils.InferenceResponse:
    """The first response to a BLS caller: which process to watch while waiting."""
    return pb_utils.InferenceResponse(
        output_tensors=[tensor(P.WORKER_PID, [pid], np.int32, batched)]
    )


def failure_response(exc: Exception, as_outputs: bool, batched: bool = False):
    """A failed request's final response: a Triton error, or for a BLS caller that is past its
    first response, the error as outputs (Triton would drop the error response)."""
    if not as_outputs:
        return error_response(exc)
    return pb_utils.InferenceResponse(
        output_tensors=[
            tensor(P.ERROR_KIND, [P.error_kind_of(exc).encode()], np.object_, batched),
            tensor(P.ERROR, [str(exc).encode("utf-8", "replace")], np.object_, batched),
        ]
    )


# Message prefixes by error kind: a gRPC stream carries an error's message but not its code,
# so clients such as the gateway read the kind from here.
_PREFIXES = ("invalid request: ", "unavailable: ")


def error_response(exc: Exception) -> pb_utils.InferenceResponse:
    code = error_code(exc)
    message = str(exc)
    if not message.startswith(_PREFIXES):  # not already prefixed by a model behind us
        if code == pb_utils.TritonError.INVALID_ARG:
            message = _PREFIXES[0] + message
        elif code == pb_utils.TritonError.UNAVAILABLE:
            message = _PREFIXES[1] + message
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _raise_for(response, what: str) -> None:
    """Every BLS sub-response is checked: a client error stays a client error, anything else
    becomes a PoolError the orchestrator can route around."""
    if not response.has_error():
        return
    err = response.error()
    if err.code() == pb_utils.TritonError.INVALID_ARG:
        raise RequestError(err.message())
    raise PoolError(f"{what}: {err.message()}")


def _raise_for_outputs(response, what: str) -> None:
    """A failure a model behind us sent as outputs (failure_response)."""
    kind = pb_utils.get_output_tensor_by_name(response, P.ERROR_KIND)
    if kind is None or not (k := kind.as_numpy().reshape(-1)[0].decode()):
        return
    message = pb_utils.get_output_tensor_by_name(response, P.ERROR)
    text = "" if message is None else message.as_numpy().reshape(-1)[0].decode("utf-8", "replace")
    raise P.error_from_kind(k, text or "failed", what)


def bls_stream(req, what: str, liveness_check_s: float = 1.0):
    """The responses of a decoupled BLS call, every failure raised (Triton errors, failures
    sent as outputs, the callee's process dying), acknowledgements included.

    The response iterator blocks forever if the callee's process dies mid-stream, so it is
    read on a helper thread while this one watches the process named by the WORKER_PID of
    the callee's acknowledgement."""
    try:
        responses = req.exec(decoupled=True)
    except pb_utils.TritonModelException as e:  # model missing, not ready
        raise PoolError(f"{what}: {e}") from e
    events: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(responses, events), daemon=True).start()
    pid = 0
    while True:
        try:
            response = events.get(timeout=liveness_check_s)
        except queue.Empty:
            if pid and not process_alive(pid):
                raise PoolError(f"{what} worker {pid} died mid-request") from None
            continue
        if response is None:
            return
        if isinstance(response, Exception):
            raise PoolError(f"{what}: {response}") from response
        _raise_for(response, what)
        _raise_for_outputs(response, what)
        worker = pb_utils.get_output_tensor_by_name(response, P.WORKER_PID)
        if worker is not None:
            pid = int(worker.as_numpy().reshape(-1)[0])
        yield response


def _output(response, name: str) -> np.ndarray:
    t = pb_utils.get_output_tensor_by_name(response, name)
    if t is None:
        raise PoolError(f"response lacks output {name!r}")
    return t.as_numpy()


# ------------------------------------------------------------------ BLS pools


class BlsPrefillPool:
    """The prefill pool as the Triton model `model_name` in this server."""

    def __init__(self, model_name: str, timeout_s: float) -> None:
        self.model_name = model_name
        self.timeout_us = int(timeout_s * 1e6)

    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Handoff:
        req = pb_utils.InferenceRequest(
            model_name=self.model_name,
            request_id=request_id,
            inputs=[
                tensor(P.PROMPT_IDS, prompt_ids, np.int32),
                tensor(P.SAMPLING, [P.sampling_to_json(params).encode()], np.object_),
            ],
            requested_output_names=[
                P.FIRST_TOKEN,
                P.RESOLVED_SEED,
                P.KV_PAYLOAD,
                P.WORKER_PID,
                P.PREFILL_TIME_US,
                P.PREFILL_START_NS,
            ],
            timeout=self.timeout_us,
            parameters=BLS_PARAMETERS,
        )
        try:
            response = req.exec()
        except pb_utils.TritonModelException as e:  # model missing, not ready, timed out
            raise PoolError(f"prefill: {e}") from e
        _raise_for(response, "prefill")
        return Handoff(
            first_token=int(_output(response, P.FIRST_TOKEN)[0]),
            seed=int(_output(response, P.RESOLVED_SEED)[0]),
            kv_payload=_output(response, P.KV_PAYLOAD),
            worker_pid=int(_output(response, P.WORKER_PID)[0]),
            prefill_time_s=int(_output(response, P.PREFILL_TIME_US)[0]) / 1e6,
            start_wall_s=int(_output(response, P.PREFILL_START_NS)[0]) / 1e9,
        )


class BlsDecodePool:
    """The decode pool as the decoupled Triton model `model_name` in this server."""

    def __init__(
        self, model_name: str, cancels: CancelRegistry, liveness_check_s: float = 1.0
    ) -> None:
        self.model_name = model_name
        self.cancels = cancels
        self.liveness_check_s = liveness_check_s

    def generate(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        handoff: Handoff | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[DecodeStep]:
        inputs = [tensor(P.SAMPLING, [P.sampling_to_json(params).encode()], np.object_)]
        if handoff is not None:
            inputs += [
                tensor(P.FIRST_TOKEN, [handoff.first_token], np.int32),
                tensor(P.RESOLVED_SEED, [handoff.seed], np.uint64),
                pb_utils.Tensor(P.KV_PAYLOAD, handoff.kv_payload),
            ]
        else:
            inputs.append(tensor(P.PROMPT_IDS, prompt_ids or [], np.int32))
        req = pb_utils.InferenceRequest(
            model_name=self.model_name,
            request_id=request_id,
            inputs=inputs,
            requested_output_names=[
                P.TOKEN_IDS,
                P.FINISH_REASON,
                P.WORKER_PID,
                P.ERROR_KIND,
                P.ERROR,
            ],
            parameters=BLS_PARAMETERS,
        )
        for response in bls_stream(req, "decode", self.liveness_check_s):
            if not response.output_tensors():  # the empty response that carries FINAL
                continue
            reason = _output(response, P.FINISH_REASON)[0].decode()
            pid = int(_output(response, P.WORKER_PID)[0])
            yield DecodeStep(
                token_ids=[int(t) for t in _output(response, P.TOKEN_IDS)],
                finish_reason=reason or None,
                worker_pid=pid,
            )

    def cancel(self, request_id: str) -> None:
        self.cancels.mark(request_id)


def _pump(responses, events: queue.Queue) -> None:
    try:
        for response in responses:
            events.put(response)
        events.put(None)
    except Exception as e:
        events.put(e)


def process_alive(pid: int) -> bool:
    """Whether a process on this host is running (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ------------------------------------------------------------------ decode responses


class SenderSink:
    """Decode output of one request, sent through its Triton response sender."""

    def __init__(
        self, sender, pid: int, to_bls: bool = False, caller: CallerWatch | None = None
    ) -> None:
        self.sender = sender
        self.pid = pid
        self.to_bls = to_bls  # failures as outputs (protocol.py): the caller is a BLS stream
        self.caller = caller or CallerWatch(0)
        self.num_sent = 0

    def send(self, token_ids: list[int], finish_reason: str | None) -> None:
        if self.caller.gone():  # DecodeService then finishes the request
            raise PoolError(f"the caller (pid {self.caller.pid}) died")
        response = pb_utils.InferenceResponse(
            output_tensors=[
                tensor(P.TOKEN_IDS, token_ids, np.int32),
                tensor(P.FINISH_REASON, [(finish_reason or "").encode()], np.object_),
                tensor(P.WORKER_PID, [self.pid], np.int32),
            ]
        )
        self.sender.send(response, flags=FINAL if finish_reason is not None else 0)
        self.num_sent += 1

    def fail(self, error: Exception) -> None:
        """The final response of a failed request (errors after a first response to a BLS
        caller travel as outputs)."""
        as_outputs = self.to_bls and self.num_sent > 0
        self.sender.send(failure_response(error, as_outputs), flags=FINAL)

    def is_cancelled(self) -> bool:
        return self.caller.gone() or self.sender.is_cancelled()


def read_kv_handoff(request, request_id: str):
    """The decode model's view of an orchestrator request: (PrefillResult | None, prompt ids)."""
    from disagg.engine import PrefillResult
    from disagg.kv_payload import KVPayload
    from disagg.trtllm import payload as trtllm_payload

    payload = _array(request, P.KV_PAYLOAD)
    if payload is None:
        prompt = _array(request, P.PROMPT_IDS)
        if prompt is None:
            raise RequestError(f"give {P.KV_PAYLOAD} (with {P.FIRST_TOKEN}) or {P.PROMPT_IDS}")
        return None, [int(t) for t in prompt.reshape(-1)]
    first = _array(request, P.FIRST_TOKEN)
    seed = _array(request, P.RESOLVED_SEED)
    if first is None or seed is None:
        raise KVPayloadError(f"{P.KV_PAYLOAD} needs {P.FIRST_TOKEN} and {P.RESOLVED_SEED}")
    data = payload.tobytes() if not payload.flags.c_contiguous else payload.data
    if trtllm_payload.is_trtllm_payload(data):  # TensorRT-LLM: DisaggregatedParams, not K/V
        kv = trtllm_payload.from_bytes(data)
    else:
        kv = KVPayload.from_bytes(data)
    return PrefillResult(
        request_id, int(first.reshape(-1)[0]), kv, int(seed.reshape(-1)[0]), 0.0
    ), None


# ------------------------------------------------------------------ router


# The orchestrator's inputs as the router forwards them (batched: [1, n]), by read kind.
_KIND_DTYPES = {
    "str": np.object_,
    "strs": np.object_,
    "int": np.int32,
    "ints": np.int32,
    "float": np.float32,
    "bool": np.bool_,
}
_ORCHESTRATOR_DTYPES = {
    P.INPUT_IDS: np.int32,
    **{name: _KIND_DTYPES[kind] for name, kind in P.GENERATION_INPUTS.items()},
    P.SEED: np.uint64,  # the one input wider than its read kind
}
_ORCHESTRATOR_OUTPUTS = [
    P.TEXT_OUTPUT,
    P.NUM_INPUT_TOKENS,
    P.NUM_OUTPUT_TOKENS,
    P.FINISH_REASON,
    P.SERVED_BY,
    P.WORKER_PID,
    P.ERROR_KIND,
    P.ERROR,
]


def _encode(value, dtype):
    values = value if isinstance(value, list) else [value]
    if dtype is np.object_:
        return [v.encode("utf-8") for v in values]
    return values


class BlsLocalPipeline:
    """The router's local target: an orchestrator model of this server, streamed over BLS.
    Cancellation marks the router's request id, which the orchestrator's id extends (see
    CancelRegistry), so decode stops that request at its next step."""

    def __init__(self, cancels: CancelRegistry) -> None:
        self.cancels = cancels

    def generate(self, model: str, request_id: str, fields: dict):
        dtypes = _ORCHESTRATOR_DTYPES
        inputs = [
            tensor(name, _encode(value, dtypes[name]), dtypes[name], batched=True)
            for name, value in fields.items()
        ]
        req = pb_utils.InferenceRequest(
            model_name=model,
            request_id=request_id,
            inputs=inputs,
            requested_output_names=_ORCHESTRATOR_OUTPUTS,
            parameters=BLS_PARAMETERS,
        )
        try:
            yield from self._replies(model, bls_stream(req, model))
        finally:
            self.cancels.clear(request_id)  # a mark, if any, has done its work

    @staticmethod
    def _replies(model: str, responses):
        from disagg.routing.router import RoutedReply

        for response in responses:
            if pb_utils.get_output_tensor_by_name(response, P.TEXT_OUTPUT) is None:
                continue  # the acknowledgement, or the empty response that carries FINAL
            reason = _output(response, P.FINISH_REASON).reshape(-1)[0].decode()
            served = pb_utils.get_output_tensor_by_name(response, P.SERVED_BY)
            yield RoutedReply(
                text=_output(response, P.TEXT_OUTPUT).reshape(-1)[0].decode("utf-8"),
                num_input_tokens=int(_output(response, P.NUM_INPUT_TOKENS).reshape(-1)[0]),
                num_output_tokens=int(_output(response, P.NUM_OUTPUT_TOKENS).reshape(-1)[0]),
                finish_reason=reason or None,
                served_by="" if served is None else served.as_numpy().reshape(-1)[0].decode(),
            )

    def cancel(self, request_id: str) -> None:
        self.cancels.mark(request_id)


def routed_response(reply, batched: bool) -> pb_utils.InferenceResponse:
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
    return pb_utils.InferenceResponse(output_tensors=outputs)


def _family_kind(kind: str):
    # looked up late: the stub that auto-completes configs has no MetricFamily
    return getattr(pb_utils.MetricFamily, kind.upper())


class _MetricsThread:
    """Applies every metric update of this model process on one thread, in order.

    Each update is a synchronous message from the stub to the server. Made from many request
    threads at once (one histogram observation per token), they crashed Triton 2.51's Python
    backend (SIGSEGV in libtriton_python.so under 8 concurrent streams); one thread also keeps
    that round trip off the request path. Updates land a moment after they are made."""

    def __init__(self) -> None:
        self.updates: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (update := self.updates.get()) is not None:
            family, labels, op, value = update
            try:
                family.apply(labels, op, value)
            except Exception:  # metrics must never take the model down
                _log.exception("metric %s: %s failed", family.spec.name, op)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Apply what is queued, then end."""
        self.updates.put(None)
        self.thread.join(timeout_s)


_metrics_thread: _MetricsThread | None = None
_metrics_lock = threading.Lock()
_families: list[Family] = []  # every Family of this process, for close_metrics


def _submit(family, labels: dict, op: str, value: float) -> None:
    global _metrics_thread
    if _metrics_thread is None:
        with _metrics_lock:
            if _metrics_thread is None:
                _metrics_thread = _MetricsThread()
    _metrics_thread.updates.put((family, labels, op, value))


def close_metrics() -> None:
    """Call from a model's finalize(): stop the metrics thread, then free every Metric and
    MetricFamily while the stub can still talk to the server. Freed later, at interpreter
    exit, their destructors reach for the stub's shared memory pool after it is gone: that
    was the SIGSEGV ("segfault at 60 ... in triton_python_backend_stub") of every stub with
    metrics at every server shutdown."""
    global _metrics_thread
    with _metrics_lock:
        if _metrics_thread is not None:
            _metrics_thread.stop()
            _metrics_thread = None
        for family in _families:
            family.close()
        _families.clear()
    gc.collect()


class Family:
    """One metric of disagg.metrics on Triton's metrics port. Label sets are created on first
    use (their values come from small closed sets); `fixed` labels go on every series."""

    def __init__(self, metric: M.Metric, **fixed: str) -> None:
        self.spec = metric
        self.fixed = fixed
        self.family = pb_utils.MetricFamily(metric.name, metric.help, _family_kind(metric.kind))
        # touched by the metrics thread only
        self.series: dict[tuple, object] = {}
        self.last_set: dict[tuple, float] = {}  # gauges: the value the server has
        _families.append(self)

    def close(self) -> None:
        """Free the series, then the family (the order the Python backend asks for)."""
        self.series.clear()
        self.family = None

    def apply(self, labels: dict[str, str], op: str, value: float) -> None:
        """One update, on the metrics thread. A gauge set to the value it already has is not
        sent: decode sets its gauges after every step, and they rarely change."""
        if self.family is None:  # closed: the model is finalizing
            return
        key = tuple(sorted(labels.items()))
        if op == "set":
            if self.last_set.get(key) == value:
                return
            self.last_set[key] = value
        series = self.series.get(key)
        if series is None:
            extra = {"buckets": list(self.spec.buckets)} if self.spec.buckets else {}
            series = self.series[key] = self.family.Metric(labels=labels, **extra)
        getattr(series, op)(value)

    def inc(self, value: float = 1.0, **labels: str) -> None:
        if value:
            _submit(self, {**self.fixed, **labels}, "increment", value)

    def set(self, value: float, **labels: str) -> None:
        _submit(self, {**self.fixed, **labels}, "set", value)

    def observe(self, value: float, **labels: str) -> None:
        _submit(self, {**self.fixed, **labels}, "observe", value)


class RouterMetrics:
    """The router's counters, on Triton's metrics port (implements RouterEvents)."""

    def __init__(self) -> None:
        self.requests = Family(M.ROUTER_REQUESTS)
        self.fallbacks = Family(M.ROUTER_FALLBACKS)
        self.retries = Family(M.ROUTER_RETRIES)
        self.endpoint_errors = Family(M.ROUTER_ENDPOINT_ERRORS)

    def decision(self, target: str, reason: str) -> None:
        self.requests.inc(target=target, reason=reason)

    def fallback(self, planned: str, cause: str) -> None:
        self.fallbacks.inc(target=planned, cause=cause)

    def retry(self, endpoint: str) -> None:
        self.retries.inc(endpoint=endpoint)

    def endpoint_error(self, endpoint: str, kind: str) -> None:
        self.endpoint_errors.inc(endpoint=endpoint, kind=kind)


class OrchestratorMetrics:
    """The orchestrator's histograms and counters (implements OrchestratorEvents)."""

    def __init__(self, model: str) -> None:
        f = {"model": model}
        self.ttft, self.itl, self.e2e = Family(M.TTFT, **f), Family(M.ITL, **f), Family(M.E2E, **f)
        self.requests, self.errors = Family(M.REQUESTS, **f), Family(M.ERRORS, **f)
        self.queue, self.prefill_s = Family(M.QUEUE), Family(M.PREFILL)
        self.kv_bytes, self.kv_s = Family(M.KV_BYTES, **f), Family(M.KV_SECONDS, **f)
        self.decisions = Family(M.DECISIONS, **f)
        self.prefill_queue = Family(M.PREFILL_QUEUE_TOKENS, **f)

    def first_token(self, served_by: str, ttft_s: float) -> None:
        self.ttft.observe(ttft_s, served_by=served_by)

    def token_gap(self, served_by: str, itl_s: float, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.itl.observe(itl_s, served_by=served_by)

    def finished(self, served_by: str, finish_reason: str, e2e_s: float) -> None:
        self.e2e.observe(e2e_s, served_by=served_by)
        self.requests.inc(served_by=served_by, finish_reason=finish_reason)

    def prefill(self, queue_s: float, compute_s: float) -> None:
        self.queue.observe(queue_s, pool="prefill")
        self.prefill_s.observe(compute_s, pool="prefill")

    def kv_handoff(self, num_bytes: int, seconds: float) -> None:
        self.kv_bytes.observe(num_bytes)
        self.kv_s.observe(seconds)

    def decision(self, remote: bool, reason: str) -> None:
        self.decisions.inc(prefill="remote" if remote else "local", reason=reason)

    def error(self, stage: str, kind: str) -> None:
        self.errors.inc(stage=stage, kind=kind)

    def load(self, load) -> None:
        self.prefill_queue.set(load.prefill_queue_tokens)


class DecodeMetrics:
    """One decode instance's gauges, updated after every engine step, and its queue and
    co-located prefill histograms (DecodeService's on_step and on_admit hooks)."""

    def __init__(self, model: str, instance: str) -> None:
        f = {"model": model, "instance": instance}
        self.active, self.batch = Family(M.DECODE_ACTIVE, **f), Family(M.DECODE_BATCH, **f)
        self.waiting, self.kv = Family(M.DECODE_WAITING, **f), Family(M.DECODE_KV_BYTES, **f)
        self.kv_capacity, self.steps = (
            Family(M.DECODE_KV_CAPACITY, **f),
            Family(M.DECODE_STEPS, **f),
        )
        self.queue, self.prefill_s = Family(M.QUEUE), Family(M.PREFILL)
        self.last_steps = 0

    def on_step(self, stats: dict) -> None:
        """Gauges from DecodeEngine.stats(); an engine that lacks a figure leaves it out."""
        running, waiting = stats.get("num_running", 0), stats.get("num_waiting", 0)
        self.active.set(running + waiting)
        self.batch.set(running)
        self.waiting.set(waiting)
        for family, key in (
            (self.kv, "kv_bytes_reserved"),
            (self.kv_capacity, "kv_bytes_capacity"),
        ):
            if key in stats:
                family.set(stats[key])
        if "num_steps" in stats:
            self.steps.inc(stats["num_steps"] - self.last_steps)
            self.last_steps = stats["num_steps"]

    def on_admit(self, queue_s: float, prefill_s: float | None) -> None:
        self.queue.observe(queue_s, pool="decode")
        if prefill_s is not None:
            self.prefill_s.observe(prefill_s, pool="decode")


def configure_logging() -> None:
    """disagg's own log lines (routing decisions, fallbacks) in the tritonserver log: the stub
    inherits the server's stderr. Level from DISAGG_LOG_LEVEL (default INFO)."""
    import logging
    import os

    logger = logging.getLogger("disagg")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("DISAGG_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


class RequestRunner:
    """How a BLS entry model (orchestrator, router) serves its requests on a thread pool.

    Decoupled: each request is parsed at once (a bad one is answered with its error) and
    then run in the pool, streaming through its response sender. Not decoupled: the batch
    Triton hands over is run in parallel and answered with one response per request.
    `run(req, emit, is_cancelled)` returns the final reply; `respond(reply)` makes a
    response of a reply."""

    def __init__(
        self,
        decoupled: bool,
        max_concurrency: int,
        parse,
        run,
        respond,
        on_error=None,
        batched: bool = True,
    ) -> None:
        self.decoupled = decoupled
        self.parse, self.run, self.respond = parse, run, respond
        self.on_error = on_error  # called with the error kind of every failed request
        self.batched = batched
        self.pid = os.getpid()
        self.workers = ThreadPoolExecutor(max_concurrency, "requests")

    def execute(self, requests):
        if not self.decoupled:
            return list(self.workers.map(self._run_sync, requests))
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = self.parse(request)
            except Exception as e:
                sender.send(self._error_response(e), flags=FINAL)  # a first response: arrives
                continue
            to_bls = is_bls_caller(request)
            if to_bls:  # before the work can finish (a response after FINAL crashes Triton)
                sender.send(ack_response(self.pid, self.batched))
            self.workers.submit(self._run_streaming, req, sender, to_bls, CallerWatch.of(request))
        return None

    def _run_sync(self, request):
        try:
            return self.respond(self.run(self.parse(request), lambda reply: None, lambda: False))
        except Exception as e:
            return self._error_response(e)

    def _run_streaming(self, req, sender, to_bls: bool = False, caller=None) -> None:
        caller = caller or CallerWatch(0)

        def emit(reply) -> None:
            if caller.gone():  # stop here: the responses would pile up for a dead process
                raise PoolError(f"the caller (pid {caller.pid}) died")
            sender.send(self.respond(reply))

        try:
            final = self.run(req, emit, lambda: caller.gone() or sender.is_cancelled())
            if caller.gone():
                _log.warning("request %s: its caller died; dropped", req.request_id)
                return
            sender.send(self.respond(final), flags=FINAL)
        except Exception as e:
            _log.warning("request %s failed: %s", req.request_id, e)
            if caller.gone():
                return
            try:
                sender.send(self._error_response(e, to_bls), flags=FINAL)
            except Exception:
                _log.exception("request %s: could not report the failure", req.request_id)

    def _error_response(self, exc: Exception, as_outputs: bool = False):
        if self.on_error is not None:
            self.on_error(error_kind(exc))
        return failure_response(exc, as_outputs, self.batched)

    def shutdown(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)
