"""Decode and a prefill pool on the same CPU cores: decode steps on every core while no
prefill computes, and on one while one does (conditional mode on one CPU server).

Decode's OpenMP workers spin between the hundreds of parallel regions of a step while its
process has one pool, which is what makes a step fast (engine/omp.py), and what starves a
prefill at nice 10 on the same cores. With the workers throttled instead (two pools), each
region wakes a sleeping worker and every step is slower, prefill or not. Here decode keeps
one pool and asks before each step whether a prefill is computing: while one is, its steps
run on the loop thread alone (the worker sleeps once its spin runs out), leaving the other
cores to the prefill; then it goes back to torch's count. The thread count changes no bit of
a step: every kernel splits its outputs across threads, never a sum (tests/model).

The signal is a lock file in the server's run directory: each prefill process holds a
shared flock on it while it computes, and decode tries an exclusive one without waiting. A
prefill process that dies drops its lock with its file descriptors, so decode never waits
on a prefill that no longer exists."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger("disagg.engine")

LOCK_NAME = "prefill-computing.lock"


class PrefillActivity:
    """Whether any prefill process of this server is computing. Prefill processes hold it
    (`computing()`), decode asks (`active()`). One per process: flock locks belong to the
    open file, so each process opens its own."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Held while the caller computes; several holders at once are fine."""
        fcntl.flock(self.fd, fcntl.LOCK_SH)  # waits only while decode looks (microseconds)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def active(self) -> bool:
        """True while some process holds `computing()`. Two system calls, no wait."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        os.close(self.fd)


class DecodeThreads:
    """Decode's thread count, set before each step on the loop thread: `shared` while a
    prefill computes, `full` (torch's count when made) otherwise."""

    def __init__(
        self,
        activity: PrefillActivity,
        shared: int = 1,
        on_shared_step: Callable[[], None] | None = None,  # a counter (pb_metrics)
    ) -> None:
        self.activity = activity
        self.on_shared_step = on_shared_step
        self.full = torch.get_num_threads()
        self.shared = max(1, min(shared, self.full))
        self.current = self.full
        self.yielded_steps = 0  # steps run with `shared` threads (tests, metrics)

    def before_step(self) -> None:
        want = self.shared if self.activity.active() else self.full
        if want != self.current:
            torch.set_num_threads(want)  # this thread's OpenMP count; its pool stays
            self.current = want
        if want != self.full:
            self.yielded_steps += 1
            if self.on_shared_step is not None:
                self.on_shared_step()
