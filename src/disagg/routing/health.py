"""Live state of one external endpoint: its circuit breaker and its rate-limit budget.

Circuit breaker (per endpoint):

    closed --(failure_threshold consecutive failures)--> open --(cooldown)--> half-open
       ^                                                   ^                      |
       `------------------ probe succeeds ----------------|---- probe fails ------'

In half-open state one request at a time is let through as a probe. Rate limits come from
the endpoint's own `x-ratelimit-*` / `retry-after` headers; the endpoint is skipped while it
says the budget is spent, instead of spending a request to hear 429 again.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float | None:
    """Seconds in a rate-limit reset header: "7.66s", "2m59.56s", "120ms", "1h2m" or "12"."""
    text = text.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(a + b for a, b in parts) != text:
        return None
    return sum(float(a) * _UNIT_S[b] for a, b in parts)


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.state = CLOSED
        self.failures = 0  # consecutive
        self.opened_at = 0.0
        self._probe_in_flight = False
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether a request may go to the endpoint now (takes the probe slot when half-open)."""
        with self._lock:
            if self.state == OPEN and self.clock() - self.opened_at >= self.cooldown_s:
                self.state = HALF_OPEN
            if self.state == CLOSED:
                return True
            if self.state == HALF_OPEN and not self._probe_in_flight:
                self._probe_in_flight = True
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self.state, self.failures, self._probe_in_flight = CLOSED, 0, False

    def record_failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self.state == HALF_OPEN or self.failures >= self.failure_threshold:
                self.state, self.opened_at = OPEN, self.clock()
            self._probe_in_flight = False

    def release(self) -> None:
        """A request that ended neither way (cancelled by the client, say) gives back the probe."""
        with self._lock:
            self._probe_in_flight = False


class RateLimits:
    """The budget the endpoint reported in its last response, and any retry-after."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.blocked_until = 0.0  # retry-after / capacity back-off
        self.remaining_requests: int | None = None
        self.remaining_tokens: int | None = None
        self.requests_reset_at = 0.0
        self.tokens_reset_at = 0.0
        self._lock = threading.Lock()

    def update(self, headers: Mapping[str, str]) -> None:
        h = {k.lower(): v for k, v in headers.items()}
        now = self.clock()
        with self._lock:
            for kind in ("requests", "tokens"):
                remaining = h.get(f"x-ratelimit-remaining-{kind}")
                if remaining is not None and remaining.strip().isdigit():
                    setattr(self, f"remaining_{kind}", int(remaining))
                reset = parse_duration(h.get(f"x-ratelimit-reset-{kind}", ""))
                if reset is not None:
                    setattr(self, f"{kind}_reset_at", now + reset)
            retry = parse_duration(h.get("retry-after", ""))
            if retry is not None:
                self.blocked_until = max(self.blocked_until, now + retry)

    def block_for(self, seconds: float) -> None:
        with self._lock:
            self.blocked_until = max(self.blocked_until, self.clock() + seconds)

    def can_send(self, est_tokens: int) -> bool:
        now = self.clock()
        with self._lock:
            if now < self.blocked_until:
                return False
            if self.remaining_requests == 0 and now < self.requests_reset_at:
                return False
            return not (
                self.remaining_tokens is not None
                and self.remaining_tokens < est_tokens
                and now < self.tokens_reset_at
            )
