"""Decode and a prefill pool on the same CPU cores (one CPU server in conditional or
disaggregated mode): decode steps on every core while no prefill computes and on one while
one does; a prefill computes on every core while decode has nothing running and on one
while it steps.

Decode's OpenMP workers spin between the hundreds of parallel regions of a step while its
process has one pool, which is what makes a step fast (engine/omp.py), and what starves a
prefill at nice 10 on the same cores. With the workers throttled instead (two pools), each
region wakes a sleeping worker and every step is slower, prefill or not. Here decode keeps
one pool and asks before each step whether a prefill is computing: while one is, its steps
run on the loop thread alone (the worker sleeps once its spin runs out), leaving the other
cores to the prefill; then it goes back to torch's count. A prefill asks as it starts and
before every layer whether decode is stepping: one thread if so (prefill_yield.py's count),
else every core, so a lone request is not prefilled on one thread. The thread count changes
no bit of a step or a prefill: every kernel splits its outputs across threads, never a sum
(tests/model).

The signals are lock files in the server's run directory: a prefill process holds a shared
flock on one while it computes, decode holds a shared flock on the other while it has
sequences to step, and each side asks by trying an exclusive one without waiting. A process
that dies drops its locks with its file descriptors, so neither side waits on a process that
no longer exists."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

PREFILL_COMPUTING = "prefill-computing.lock"
DECODE_STEPPING = "decode-stepping.lock"


class Activity:
    """Whether any process of this server holds the lock `name`: holders call `hold()` /
    `release()` (or `computing()`), the other side asks `active()`. One per process and
    name: flock locks belong to the open file, so each process opens its own."""

    def __init__(self, run_dir: str | Path, name: str) -> None:
        self.path = Path(run_dir) / name
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.held = False

    def hold(self) -> None:
        """Several holders at once are fine; waits only while another side looks
        (microseconds)."""
        if not self.held:
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            self.held = True

    def release(self) -> None:
        if self.held:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.held = False

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        self.hold()
        try:
            yield
        finally:
            self.release()

    def active(self) -> bool:
        """True while some other process holds it. Two system calls, no wait."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        os.close(self.fd)


class DecodeThreads:
    """Decode's side, on its loop thread: `before_step()` sets the thread count (`shared`
    while a prefill computes, `full`, torch's count when made, otherwise) and says decode is
    stepping; `idle()` says it has nothing to step. With `yields` False the count stays
    `full` (a decode whose workers sleep anyway: two pools) and decode only says it steps,
    so a prefill beside it still keeps to its shared count."""

    def __init__(
        self,
        run_dir: str | Path,
        shared: int = 1,
        on_shared_step: Callable[[], None] | None = None,  # a counter (pb_metrics)
        yields: bool = True,
    ) -> None:
        self.prefill = Activity(run_dir, PREFILL_COMPUTING)
        self.stepping = Activity(run_dir, DECODE_STEPPING)
        self.on_shared_step = on_shared_step
        self.yields = yields
        self.full = torch.get_num_threads()
        self.shared = max(1, min(shared, self.full))
        self.current = self.full
        self.shared_steps = 0  # steps run with `shared` threads (tests, metrics)

    def before_step(self) -> None:
        self.stepping.hold()
        if not self.yields:  # no count to change: no need to ask about the prefill
            return
        want = self.shared if self.prefill.active() else self.full
        if want != self.current:
            torch.set_num_threads(want)  # this thread's OpenMP count; its pool stays
            self.current = want
        if want != self.full:
            self.shared_steps += 1
            if self.on_shared_step is not None:
                self.on_shared_step()

    def idle(self) -> None:
        self.stepping.release()

    def close(self) -> None:
        for activity in (self.prefill, self.stepping):
            activity.close()


class PrefillThreads:
    """A prefill process's side: `computing()` holds its lock and sets the calling thread's
    count, `shared` while decode steps and `full` (every core) while it idles, as it starts
    and again before every layer (`between_layers`): a prefill that began while decode idled
    must not keep every core once decode steps, or its threads wait on each other at every
    parallel region while decode holds one of their cores (measured: 16 chat streams at 48
    tok/s against 126 with one thread throughout)."""

    def __init__(self, run_dir: str | Path, full: int, shared: int) -> None:
        self.computing_ = Activity(run_dir, PREFILL_COMPUTING)
        self.decode = Activity(run_dir, DECODE_STEPPING)
        self.full, self.shared = max(full, 1), max(shared, 1)

    def adjust(self) -> int:
        """The count for now, set on the calling thread; returned."""
        threads = self.shared if self.decode.active() else self.full
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def between_layers(self, stop: Callable[[], bool]) -> Callable[[], bool]:
        """`stop` (asked before every layer) that also adjusts the count."""

        def adjusted() -> bool:
            self.adjust()
            return stop()

        return adjusted

    @contextlib.contextmanager
    def computing(self) -> Iterator[int]:
        """Yields the thread count chosen as it starts."""
        with self.computing_.computing():
            yield self.adjust()

    def close(self) -> None:
        for activity in (self.computing_, self.decode):
            activity.close()
