"""How a BLS entry model (orchestrator, router) serves its requests on a thread pool."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from disagg.cancel import CancelRegistry, CancelWatch
from disagg.contracts import error_kind_of
from disagg.errors import PoolError
from disagg.triton.bls import (
    CallerWatch,
    ack_response,
    failure_response,
    is_bls_caller,
    wants_ack,
)
from disagg.triton.pb import FINAL, requested_outputs

if TYPE_CHECKING:
    import triton_python_backend_utils as pb_utils

_log = logging.getLogger("disagg.triton")


class _Request(Protocol):
    @property
    def request_id(self) -> str: ...


Req = TypeVar("Req", bound=_Request)  # what `parse` makes of a Triton request
Reply = TypeVar("Reply")  # what `run` emits and returns
Reply_contra = TypeVar("Reply_contra", contravariant=True)


class Respond(Protocol[Reply_contra]):
    def __call__(
        self, reply: Reply_contra, requested: frozenset[str] = ...
    ) -> pb_utils.InferenceResponse: ...


class RequestRunner(Generic[Req, Reply]):
    """How a BLS entry model (orchestrator, router) serves its requests on a thread pool.

    Decoupled: each request is parsed at once (a bad one is answered with its error) and
    then run in the pool, streaming through its response sender. Not decoupled: the batch
    Triton hands over is run in parallel and answered with one response per request.
    `run(req, emit, is_cancelled)` returns the final reply; `respond(reply, requested)` makes a
    response of a reply. With `cancels`, a streaming request Triton cancels is marked there
    at once (CancelWatch), and a mark on its id (or its caller's) cancels it."""

    def __init__(
        self,
        decoupled: bool,
        max_concurrency: int,
        parse: Callable[[pb_utils.InferenceRequest], Req],
        run: Callable[[Req, Callable[[Reply], None], Callable[[], bool]], Reply],
        respond: Respond[Reply],
        on_error: Callable[[str], None] | None = None,
        batched: bool = True,
        cancels: CancelRegistry | None = None,
    ) -> None:
        self.decoupled = decoupled
        self.parse, self.run, self.respond = parse, run, respond
        self.on_error = on_error  # called with the error kind of every failed request
        self.batched = batched
        self.pid = os.getpid()
        self.workers = ThreadPoolExecutor(max_concurrency, "requests")
        self.cancels = cancels
        self.watch = CancelWatch(cancels) if cancels is not None else None

    def execute(
        self, requests: Iterable[pb_utils.InferenceRequest]
    ) -> list[pb_utils.InferenceResponse] | None:
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
            if wants_ack(request):  # before the work can finish (a response after FINAL
                sender.send(ack_response(self.pid, self.batched))  # crashes Triton)
            self.workers.submit(
                self._run_streaming,
                req,
                sender,
                to_bls,
                CallerWatch.of(request),
                requested_outputs(request),
            )
        return None

    def _run_sync(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        try:
            return self.respond(self.run(self.parse(request), lambda reply: None, lambda: False))
        except Exception as e:
            return self._error_response(e)

    def _run_streaming(
        self,
        req: Req,
        sender: pb_utils.InferenceResponseSender,
        to_bls: bool = False,
        caller: CallerWatch | None = None,
        requested: frozenset[str] = frozenset(),
    ) -> None:
        caller = caller or CallerWatch(0)

        def emit(reply: Reply) -> None:
            if caller.gone():  # stop here: the responses would pile up for a dead process
                raise PoolError(f"the caller (pid {caller.pid}) died")
            sender.send(self.respond(reply, requested))

        def triton_cancelled() -> bool:
            return caller.gone() or sender.is_cancelled()

        def is_cancelled() -> bool:
            marks = self.cancels
            return triton_cancelled() or (marks is not None and marks.is_marked(req.request_id))

        # (a BLS caller cannot cancel its call: it marks its own id, which this one extends)
        watch = None if to_bls else self.watch
        if watch is not None:
            watch.add(req.request_id, triton_cancelled)

        def unwatch() -> None:  # before the final response: Triton frees the request with it
            if watch is not None:
                watch.remove(req.request_id)

        try:
            final = self.run(req, emit, is_cancelled)
            unwatch()
            if caller.gone():
                _log.warning("request %s: its caller died; dropped", req.request_id)
                return
            sender.send(self.respond(final, requested), flags=FINAL)
        except Exception as e:
            unwatch()
            _log.warning("request %s failed: %s", req.request_id, e)
            if caller.gone():
                return
            try:
                sender.send(self._error_response(e, to_bls), flags=FINAL)
            except Exception:
                _log.exception("request %s: could not report the failure", req.request_id)
        finally:
            if watch is not None:
                watch.remove(req.request_id)

    def _error_response(
        self, exc: Exception, as_outputs: bool = False
    ) -> pb_utils.InferenceResponse:
        if self.on_error is not None:
            self.on_error(error_kind_of(exc))
        return failure_response(exc, as_outputs, self.batched)

    def shutdown(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self.workers.shutdown(wait=False, cancel_futures=True)
