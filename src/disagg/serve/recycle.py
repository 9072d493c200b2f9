"""Replace tritonserver, losing no request, before what crashed stubs leave behind adds up
(issue 27 item 2).

Triton 2.51 keeps the shared memory region of every stub that died mapped for the server's
life, and the threads of each reload and of the BLS readers a dead stub left blocked
(docs/reliability.md, "Why a crash used to hang router and gateway requests"): no code in a
model can release them. So `disagg serve` measures the server (tritonserver and its stubs:
threads, RSS, regions still mapped whose file is gone) after each start, and when stubs have
died since (`recycle_after_faults` of them, or any with the threads grown by
`recycle_thread_growth` over that start), it replaces the server on a schedule that loses
no gateway request:

1. hold: new gateway requests wait (disagg/hold.py) instead of reaching this server;
2. drain: the requests the gateway is serving finish (up to `recycle_drain_s`);
3. restart: SIGINT (direct Triton clients get `drain_s`), a fresh tritonserver, READY;
4. release: the held requests go to the new server.

Held requests see the restart as a longer time to their first token. Clients of Triton's own
ports are refused while it restarts, as in any single-server restart. A server without
faults is never recycled. Without the gateway beside it there is nothing to hold: a server
of role "all" with `gateway_enabled` off is not recycled (a gateway elsewhere cannot see the
hold); a pool server (role prefill or decode) is, with Triton's own drain (`drain_s`), and
its frontends send to its other replicas meanwhile, as when one restarts for any reason.
"""

from __future__ import annotations

import logging
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from disagg import status as S
from disagg.hold import Hold
from disagg.serve.supervisor import SHM_PREFIX, stub_processes
from disagg.settings import ServeSettings

log = logging.getLogger("disagg.recycle")


@dataclass(frozen=True)
class Footprint:
    threads: int  # tritonserver's and its live stubs'
    rss_mb: float
    dead_regions: int  # stub regions tritonserver still maps although their file is gone

    def __str__(self) -> str:
        return f"{self.threads} threads, {self.rss_mb:.0f} MB RSS, {self.dead_regions} dead regions"


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def footprint(server_pid: int) -> Footprint:
    threads, rss_kb = 0, 0.0
    for pid in [server_pid, *stub_processes(server_pid)]:
        try:
            st = _status(pid)
        except OSError:  # gone meanwhile
            continue
        threads += int(st.get("Threads", "0"))
        rss_kb += float(st.get("VmRSS", "0 kB").split()[0])
    dead = set()
    try:
        for line in Path(f"/proc/{server_pid}/maps").read_text().splitlines():
            if SHM_PREFIX in line and line.endswith("(deleted)"):
                dead.add(line.split()[5])
    except OSError:
        pass
    return Footprint(threads, rss_kb / 1024, len(dead))


CHECK_S = 5.0  # how often `check` measures the server


class Recycler:
    def __init__(self, after_faults: int, thread_growth: float) -> None:
        """`after_faults` (0: never by count): dead stubs' regions that call for a restart;
        `thread_growth` (0: never by threads): with any dead stub, threads grown this much
        over the level at the start."""
        self.after_faults = after_faults
        self.thread_growth = thread_growth
        self.baseline: Footprint | None = None
        self.next_check = time.monotonic() + CHECK_S

    @classmethod
    def for_settings(cls, s: ServeSettings) -> Recycler:
        """The settings' triggers; none for a server of role all without its gateway, where
        nothing would hold the requests a restart would cut."""
        if s.role == "all" and not s.gateway_enabled:
            return cls(0, 0.0)
        return cls(s.recycle_after_faults, s.recycle_thread_growth)

    def check(self, server_pid: int) -> str | None:
        """Every CHECK_S (else None at once): why the server should be replaced, or None."""
        if time.monotonic() < self.next_check:
            return None
        self.next_check = time.monotonic() + CHECK_S
        return self.due(footprint(server_pid))

    def settle(self, server_pid: int) -> Footprint:
        self.baseline = footprint(server_pid)
        return self.baseline

    def due(self, now: Footprint) -> str | None:
        """Why the server should be replaced now, or None. Until a stub dies, the baseline
        follows the server's highest thread count (its first requests start threads too)."""
        if self.baseline is None:
            return None
        if now.dead_regions == 0:
            if now.threads > self.baseline.threads:
                self.baseline = now
            return None
        if self.after_faults and now.dead_regions >= self.after_faults:
            return f"{now.dead_regions} stubs died since it started ({now})"
        grown = now.threads / max(1, self.baseline.threads) - 1
        if self.thread_growth and grown >= self.thread_growth:
            return f"threads {self.baseline.threads} -> {now.threads} after stubs died ({now})"
        return None


def gateway_busy(metrics_url: str) -> float:
    """Requests the gateway is serving (held ones are not counted in flight: they wait
    before it)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        samples = S.parse(r.read().decode())
    return S.total(samples, "disagg_gateway_inflight_requests")


UNREADABLE_S = 5.0  # a gateway unreadable this long is gone, and what it served with it


def drain(
    hold: Hold,
    metrics_url: str | None,
    drain_s: float,
    hold_s: float,
    stopped: Callable[[], bool] = lambda: False,
) -> float:
    """Hold new gateway requests and wait for the ones being served to finish (at most
    `drain_s`, or until `stopped()`); returns how many were still going when it stopped
    waiting."""
    hold.begin(hold_s)
    if metrics_url is None:
        return 0.0
    deadline = time.monotonic() + drain_s
    busy, unreadable_since = 0.0, None
    while time.monotonic() < deadline and not stopped():
        try:
            busy, unreadable_since = gateway_busy(metrics_url), None
        except OSError as e:
            unreadable_since = unreadable_since or time.monotonic()
            if time.monotonic() - unreadable_since > UNREADABLE_S:
                log.warning("the gateway's metrics unreadable for %.0f s (%s)", UNREADABLE_S, e)
                return 0.0
        else:
            if busy <= 0:
                return 0.0
        time.sleep(0.2)
    return busy
