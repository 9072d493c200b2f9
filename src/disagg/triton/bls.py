"""The contract of calls between the models of one server (BLS): who may call an internal
model, the caller's and the callee's liveness, acknowledgements, and failures that must not
get lost inside a BLS stream (contracts.py, "failures inside a BLS stream"). The pools built
on it are the callers in pools.py (the orchestrator's) and local_pipeline.py (the
router's), and the callees' sides in prefill_side.py and decode_side.py."""

from __future__ import annotations

import collections
import hmac
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator

import triton_python_backend_utils as pb_utils

from disagg import contracts as C
from disagg.codec.tensors import ACK, FAILURE, encode_ack, encode_failure, raise_for_failure
from disagg.errors import PoolError, RequestError
from disagg.process import process_alive
from disagg.triton.pb import (
    error_response,
    output_arrays,
    raise_for_error,
    request_parameters,
    tensors,
)


def is_bls_caller(request: pb_utils.InferenceRequest) -> bool:
    """Whether another model of this server sent `request` over BLS (see contracts.py)."""
    return request_parameters(request).get(C.CALLER_PARAM) == C.BLS_CALLER


def wants_ack(request: pb_utils.InferenceRequest) -> bool:
    """Whether the caller watches the process that serves `request` (a BLS caller, or a
    client asking with ACK_PARAM): it gets an acknowledgement with that pid first."""
    return is_bls_caller(request) or request_parameters(request).get(C.ACK_PARAM) is True


def check_internal(request: pb_utils.InferenceRequest, model: str) -> None:
    """Refuse a request to an internal model that did not come from this server's own BLS
    calls (it carries this server's token; see contracts.py)."""
    token = C.internal_token()
    given = str(request_parameters(request).get(C.TOKEN_PARAM, ""))
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise RequestError(
            f"'{model}' is internal to this server's pipeline and takes no requests from "
            "clients: send them to 'router' (or 'ensemble'), or to the gateway"
        )


# what a BLS call sends (is_bls_caller, check_internal, CallerWatch)
BLS_PARAMETERS = {
    C.CALLER_PARAM: C.BLS_CALLER,
    C.TOKEN_PARAM: C.internal_token(),
    C.CALLER_PID_PARAM: os.getpid(),
}


class CallerWatch:
    """Whether the model process that sent a BLS request has died (contracts.py,
    CALLER_PID_PARAM); pid 0 watches nothing. Asked before every send (a send to a caller
    that died can block for good), so it reads /proc every time by default (~10 us)."""

    def __init__(self, pid: int, interval_s: float = 0.0) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self._next = 0.0
        self._gone = False

    @classmethod
    def of(cls, request: pb_utils.InferenceRequest) -> CallerWatch:
        try:
            pid = int(request_parameters(request).get(C.CALLER_PID_PARAM, 0))
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
    return pb_utils.InferenceResponse(output_tensors=tensors(encode_ack(pid, batched)))


def failure_response(
    exc: Exception, as_outputs: bool, batched: bool = False
) -> pb_utils.InferenceResponse:
    """A failed request's final response: a Triton error, or for a BLS caller that is past its
    first response, the error as outputs (Triton would drop the error response)."""
    if not as_outputs:
        return error_response(exc)
    return pb_utils.InferenceResponse(output_tensors=tensors(encode_failure(exc, batched)))


def bls_stream(
    req: pb_utils.InferenceRequest,
    what: str,
    liveness_check_s: float = 1.0,
    first_s: float | None = None,
    stall_s: float | None = None,
    hang_s: float | None = None,
) -> Iterator[pb_utils.InferenceResponse]:
    """The responses of a decoupled BLS call, every failure raised (Triton errors, failures
    sent as outputs, the callee's process dying, silence past a limit), acknowledgements
    included.

    The call and its response iterator can block for good: Triton may hand the call to an
    instance whose stub has died, and then `exec` never returns; a response iterator never
    ends if the callee's process dies mid-stream. So both run on a helper thread while this
    one watches the process named by the WORKER_PID of the callee's acknowledgement, and
    the limits (None: none) bound the silence before the first response (`first_s`), between
    the first and the second (`stall_s`: the callee may wait for a slot or prefill first)
    and between later ones (`hang_s`). Past one, PoolError: before the first response the
    callee never took the call (recovery retries it), after it the stream moves on."""
    events: queue.Queue[pb_utils.InferenceResponse | Exception | None] = queue.Queue()
    threading.Thread(target=_pump, args=(req, events), daemon=True).start()
    pid, seen, last = 0, 0, time.monotonic()
    while True:
        limit = first_s if seen == 0 else stall_s if seen == 1 else hang_s
        try:
            response = events.get(timeout=liveness_check_s)
        except queue.Empty:
            if pid and not process_alive(pid):
                raise PoolError(f"{what} worker {pid} died mid-request") from None
            if limit is not None and time.monotonic() - last >= limit:
                after = "" if seen == 0 else f" after {seen} response(s)"
                raise PoolError(f"{what}: no response in {limit:g} s{after}") from None
            continue
        seen, last = seen + 1, time.monotonic()
        if response is None:
            return
        if isinstance(response, Exception):  # (model missing, not ready, ...)
            raise PoolError(f"{what}: {response}") from response
        raise_for_error(response, what)
        contract = output_arrays(response, ACK.names + FAILURE.names)
        raise_for_failure(contract, what)  # a failure sent as outputs (failure_response)
        if C.WORKER_PID in contract:
            pid = int(contract[C.WORKER_PID].reshape(-1)[0])
        yield response


def _pump(
    req: pb_utils.InferenceRequest,
    events: queue.Queue[pb_utils.InferenceResponse | Exception | None],
) -> None:
    responses: Iterable[pb_utils.InferenceResponse] | None = None
    try:
        responses = req.exec(decoupled=True)
        for response in responses:
            events.put(response)
        events.put(None)
    except Exception as e:
        events.put(e)
    finally:
        if responses is not None:
            FINISHED_STREAMS.keep(responses)


class Graveyard:
    """Holds objects for `keep_s` before Python lets go of them.

    Why: the stub also holds each BLS response iterator, in its response_iterator_map_,
    and drops that reference on its own cleanup thread, without the GIL (SendCleanupId).
    When that is the last reference, the iterator's responses are freed there, numpy arrays
    and all, and Python objects freed without the GIL corrupt CPython's allocator: the
    orchestrator stub's "segfault at 18 ... in libpython3.11" (pymalloc's pool list) after
    minutes of 16-stream load. Held here for seconds after the stream ends, Python's
    reference is the last one, dropped with the GIL."""

    def __init__(self, keep_s: float = 30.0) -> None:
        self.keep_s = keep_s
        self._items: collections.deque[tuple[float, object]] = collections.deque()
        self._lock = threading.Lock()

    def keep(self, item: object, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._items.append((now, item))
            while self._items and now - self._items[0][0] > self.keep_s:
                self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Let go of everything: from finalize(), while the stub is alive. An iterator still
        held at interpreter exit is destroyed after the stub is gone (a segfault in GC)."""
        with self._lock:
            self._items.clear()


FINISHED_STREAMS = Graveyard()
