"""Simulated time: an event loop, and the nodes work runs on.

`EventLoop` calls each scheduled callback at its time, in time order (ties in the order they
were scheduled), and `now` is that time: nothing waits for a real clock.

`Node` is one machine's compute. Jobs on it (a prefill, a decode step) share it: with k jobs
in progress each advances at 1 / (1 + contention * (k - 1)) of its full speed, so a
contention of 1 is fair sharing of the cores (two processes on the same two cores each get
half) and 0 is hardware that does not slow down (separate devices). A job's `work_s` is how
long it takes alone, as the profile measured it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

EPS_S = 1e-9  # a job this close to done is done (float error of times ~1e3 s)


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        assert t >= self.now - 1e-12, "an event in the past"
        heapq.heappush(self._heap, (max(t, self.now), next(self._order), fn))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    def run(self) -> None:
        """Until nothing is scheduled."""
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn()


@dataclass
class _Job:
    remaining_s: float  # of work at full speed
    done: Callable[[float], None]  # called with the job's elapsed (simulated) seconds
    started_s: float


class Node:
    def __init__(self, loop: EventLoop, name: str, contention: float = 1.0) -> None:
        if contention < 0:
            raise ValueError("contention must be >= 0")
        self.loop = loop
        self.name = name
        self.contention = contention
        self._jobs: list[_Job] = []
        self._since = 0.0  # when `remaining_s` were last brought up to date
        self._version = 0  # the completion event scheduled last (older ones are stale)
        self.busy_s = 0.0  # time with at least one job in progress

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def run(self, work_s: float, done: Callable[[float], None]) -> None:
        """Start a job of `work_s` seconds (alone); `done(elapsed_s)` when it completes."""
        self._advance()
        self._jobs.append(_Job(max(work_s, 0.0), done, self.loop.now))
        self._schedule()

    def _rate(self) -> float:
        return 1.0 / (1.0 + self.contention * (len(self._jobs) - 1)) if self._jobs else 1.0

    def _advance(self) -> None:
        now = self.loop.now
        elapsed = now - self._since
        if self._jobs and elapsed > 0:
            self.busy_s += elapsed
            rate = self._rate()
            for job in self._jobs:
                job.remaining_s -= elapsed * rate
        self._since = now

    def _schedule(self) -> None:
        self._version += 1
        if not self._jobs:
            return
        version = self._version
        first = min(j.remaining_s for j in self._jobs)
        self.loop.after(max(first, 0.0) / self._rate(), lambda: self._complete(version))

    def _complete(self, version: int) -> None:
        if version != self._version:
            return  # the set of jobs changed since: a later event stands for this one
        self._advance()
        done = [j for j in self._jobs if j.remaining_s <= EPS_S]
        self._jobs = [j for j in self._jobs if j.remaining_s > EPS_S]
        self._schedule()
        for job in done:
            job.done(self.loop.now - job.started_s)
