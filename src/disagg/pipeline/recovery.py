"""What the orchestrator does when decode fails under a request (no Triton here).

A failure mid-stream (decode had acknowledged the request) is a fault: the request is
continued by another decode at once, up to `migration_limit` faults per request; the next
decode prefills the prompt plus the tokens already sent (Orchestrator._continue_from_tokens).
Where that decode is depends on the pool: another replica (remote/pools.py), the other
instance of this server's decode model that Triton hands the call to, or, with one instance,
the same model once the supervisor has restarted it (serve/supervisor.py).

Until a decode takes the request, every try fails at once: the model is unloading or
loading ("not ready"), Triton handed the call to the dead instance ("stub process is not
healthy"), no replica is up. Those tries repeat every `poll_s` for up to `recover_s` after
the failure; past that the request fails with the last error. Polling the call itself, not
a readiness API: a model whose stub died still reports READY until the supervisor notices.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from disagg.errors import PoolError


class DecodeRecovery:
    """One request's decode failures, as they come."""

    def __init__(
        self,
        migration_limit: int,
        recover_s: float,
        is_cancelled: Callable[[], bool],
        poll_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.migration_limit = migration_limit
        self.recover_s = recover_s
        self.is_cancelled = is_cancelled
        self.poll_s = poll_s
        self.clock, self.sleep = clock, sleep
        self.num_faults = 0  # failures after decode had taken the request
        self.deadline: float | None = None  # of the wait for a decode to take it again
        self.expired = False  # gave up because that wait ran out

    def may_retry(self, was_serving: bool) -> bool:
        """After decode failed: whether to try again now (having waited a poll interval if
        decode refused the request); False: give up (too many faults, the client left, or
        decode not back in time)."""
        if was_serving:
            self.num_faults, self.deadline = self.num_faults + 1, None
            # at once: another instance or replica may take it
            return self.num_faults <= self.migration_limit and not self.is_cancelled()
        if self.deadline is None:
            self.deadline = self.clock() + self.recover_s
        left = self.deadline - self.clock()
        if left <= 0 or self.is_cancelled():
            self.expired = left <= 0 < self.recover_s  # (with no wait: the error as it was)
            return False
        self.sleep(min(self.poll_s, left))
        return not self.is_cancelled()

    def error(self, e: PoolError) -> PoolError:
        """The error to raise when the wait expired: `e`, and how long decode had."""
        return PoolError(f"{e} (decode was not back within {self.recover_s:g} s)")
