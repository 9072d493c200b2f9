"""Cancellation that reaches another process: a directory of marker files.

The orchestrator cannot cancel a BLS stream it started (Triton 2.51's Python backend has no
cancel on a response iterator), and with several decode instances it cannot address the one
serving a request. So it marks the request id here, and every decode instance looks for
the ids it is serving between steps.

Ids form a hierarchy with dots (the scheme is in contracts.py): the orchestrator names a
request `<caller's id>.<hex>`, and a mark on the caller's id (the router's, say) cancels it
too, since the caller cannot know the id the orchestrator made. Ids that are not safe file
names are never marked or matched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from disagg.contracts import SAFE_REQUEST_ID as _SAFE_ID

log = logging.getLogger("disagg.cancel")


class CancelRegistry:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, request_id: str) -> Path:
        if not _SAFE_ID.match(request_id):
            raise ValueError(f"unsafe request id for the cancel registry: {request_id!r}")
        return self.directory / request_id

    def mark(self, request_id: str) -> None:
        self._path(request_id).touch()

    def is_marked(self, request_id: str) -> bool:
        """Whether this id or one it extends (`a` for `a.b`) is marked."""
        if _SAFE_ID.match(request_id) is None:
            return False
        parts = request_id.split(".")
        return any(
            (self.directory / ".".join(parts[:n])).exists() for n in range(len(parts), 0, -1)
        )

    def clear(self, request_id: str) -> None:
        if _SAFE_ID.match(request_id):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(request_id))


class Throttled:
    """`check` asked at most once per `interval_s`, and True for good once it said so: for a
    loop that asks often (a prefill, between layers) what costs an IPC or a stat to learn."""

    def __init__(self, check: Callable[[], bool], interval_s: float = 0.01) -> None:
        self.check = check
        self.interval_s = interval_s
        self._next = 0.0
        self._cancelled = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self._cancelled and now >= self._next:
            self._next = now + self.interval_s
            self._cancelled = self.check()
        return self._cancelled

    def now(self) -> bool:
        """Asked now, whatever the interval: for the last look before an answer that would
        be lost if the caller has gone."""
        self._next = 0.0
        return self()


class CancelWatch:
    """Marks a request's id in `cancels` as soon as its own check says it was cancelled, even
    while the thread serving it waits (on a prefill, say, which sends nothing for seconds):
    one thread asks every check every `poll_s`. So a client that leaves during a prefill is
    seen by the prefill model (which reads the marks between layers), by the orchestrator
    (which then hands nothing to decode) and by decode, without a response to carry it."""

    def __init__(self, cancels: CancelRegistry, poll_s: float = 0.05) -> None:
        self.cancels = cancels
        self.poll_s = poll_s
        self._checks: dict[str, Callable[[], bool]] = {}
        self._marked: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, request_id: str, check: Callable[[], bool]) -> None:
        with self._lock:
            self._checks[request_id] = check
            if self._thread is None:  # (started by the first request: none in unit tests)
                self._thread = threading.Thread(target=self._run, name="cancel-watch", daemon=True)
                self._thread.start()

    def remove(self, request_id: str) -> None:
        """The request ended: its mark, if this made one, has done its work."""
        with self._lock:  # (mark and clear under the lock: no mark left behind by a race)
            self._checks.pop(request_id, None)
            if request_id in self._marked:
                self._marked.discard(request_id)
                self.cancels.clear(request_id)

    def poll(self) -> list[str]:
        """Ask every check once; mark the ids newly cancelled (returned). The checks run under
        the lock, so once `remove` returns no check of that request is running or will run:
        a check asks Triton about the request (is_cancelled), and asking after its final
        response crashed tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled:
        the factory is freed with that response)."""
        with self._lock:
            newly = []
            for rid, check in list(self._checks.items()):
                if rid in self._marked:
                    continue
                try:
                    if check():
                        newly.append(rid)
                except Exception as e:  # not cancelled, as far as this can tell
                    log.debug("request %s: cancel check failed: %s", rid, e)
            for rid in newly:
                self._marked.add(rid)
                self.cancels.mark(rid)
        return newly

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
