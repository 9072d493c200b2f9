"""A pool's replicas on other servers: who they are, which to use next, which to leave out.

Replicas come from a setting, either a list of gRPC addresses or a DNS name that resolves to
many (a Kubernetes headless Service), re-resolved every `resolve_s`:

    "10.0.0.5:8001,10.0.0.6:8001"      fixed replicas
    "dns:prefill.disagg.svc:8001"      every address the name has, now and later
    "file:/etc/disagg/prefill.txt"     the host:port lines of a file, re-read (a list that
                                       configuration management or a script keeps)

No coordinator (etcd, NATS) is involved. A request that names its prompt is given the
replica of least cost by the blocks each holds and its load (cache_route.py, replica_choice
cache_aware). Otherwise, or with replica_choice load, a replica is chosen by load alone: for
decode, what the server itself reported with its last responses (sequences waiting for a
slot first, then running ones: other frontends' included; then the most free KV cache)
while that report is fresh (`report_s`), else the requests this frontend has outstanding on
it; ties in turn. One that fails a connection, or whose KV event stream breaks, is ejected
for `eject_s` and is only readmitted once its health probe (Triton's model-ready) passes; a
new address joins once its probe passes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from disagg.errors import ConfigError
from disagg.remote.cache_route import (
    Candidate,
    Held,
    PromptKey,
    ReplicaCache,
    RouteParams,
    decode_candidate,
    pick,
)

log = logging.getLogger("disagg.remote")
RESOLVE_S = 5.0  # a dns: name or file: list is looked at again this often


@dataclass
class Replica:
    address: str  # host:port of the server's Triton gRPC endpoint
    outstanding: int = 0
    ejected_until: float = 0.0  # 0: in rotation
    probed: bool = False  # a new replica takes traffic after its first passing probe
    requests: int = 0
    failures: int = 0
    ejections: int = 0
    order: int = field(default=0, compare=False)
    # what the replica last reported of its own load (decode: running, waiting, free slots,
    # free KV tokens or -1)
    reported: tuple[int, int, int, int] | None = None
    reported_at: float = 0.0
    cache: ReplicaCache = field(default_factory=ReplicaCache, compare=False)
    work_tokens: int = 0  # tokens of work this frontend has in flight on it
    prompt_tokens: int = 0  # prompt tokens of the requests chosen for it, by the cache view
    held_tokens: int = 0  # ... of those, the ones it held when chosen
    follower: Follower | None = field(default=None, compare=False)


class Follower(Protocol):
    def stop(self) -> None: ...


@dataclass(frozen=True)
class Choice:
    replica: Replica
    held: Held  # what it holds of the prompt (0 when chosen by load alone)


def parse_spec(spec: str) -> tuple[list[str], tuple[str, int] | None]:
    """(fixed addresses, (dns name, port) or ("file:<path>", 0) or None)."""
    spec = spec.strip()
    if spec.startswith("file:"):
        if not spec[5:]:
            raise ConfigError(f"replica list {spec!r}: expected file:<path>")
        return [], (spec, 0)
    if spec.startswith("dns:"):
        name, _, port = spec[4:].rpartition(":")
        if not name or not port.isdigit():
            raise ConfigError(f"replica list {spec!r}: expected dns:<name>:<port>")
        return [], (name, int(port))
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"replica {a!r}: expected host:port")
    return addresses, None


def resolve(name: str, port: int) -> list[str]:
    if name.startswith("file:"):
        with open(name[5:]) as f:
            lines = [line.split("#", 1)[0].strip() for line in f]
        addresses = [a for a in lines if a]
        parse_spec(",".join(addresses))  # host:port each, or ConfigError
        return addresses
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    hosts = sorted({str(info[4][0]) for info in infos})  # an IPv4 or IPv6 address
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


class ReplicaSet:
    def __init__(
        self,
        spec: str,
        probe: Callable[[str], bool],
        resolve_s: float = RESOLVE_S,
        eject_s: float = 2.0,
        resolver: Callable[[str, int], list[str]] = resolve,
        clock: Callable[[], float] = time.monotonic,
        report_s: float = 2.0,
        route: RouteParams | None = None,
        follow: Callable[[Replica, Callable[[str], None]], Follower] | None = None,
        decode: bool = False,
    ) -> None:
        """`route`: how a prompt's replica is chosen (None: by load alone). `follow(r,
        lost)` starts following a new replica's KV events (the returned object stops it when
        r leaves; `lost(why)` ejects r when a stream that was up ends). `decode`: the
        replicas report a decode engine's load."""
        self.report_s = report_s
        self.route = route
        self.follow = follow
        self.decode = decode
        self.fixed, self.dns = parse_spec(spec)
        self.probe = probe
        self.resolve_s = resolve_s
        self.eject_s = eject_s
        self.resolver = resolver
        self.clock = clock
        self._replicas: dict[str, Replica] = {}
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._next_resolve = 0.0
        self._refresh(self.fixed)

    def __bool__(self) -> bool:
        return bool(self.fixed or self.dns)

    @property
    def replicas(self) -> list[Replica]:
        with self._lock:
            return list(self._replicas.values())

    def _refresh(self, addresses: list[str]) -> None:
        with self._lock:
            for a in addresses:
                if a not in self._replicas:
                    r = self._replicas[a] = Replica(a, order=len(self._replicas))
                    if self.route is not None:
                        r.cache = ReplicaCache(self.route.capacity_tokens, self.route.block_size)
                    if self.follow is not None:
                        r.follower = self.follow(r, self._ejector(r))
                    log.info("replica %s found", a)
            for a in set(self._replicas) - set(addresses):
                log.info("replica %s is gone from %s", a, self.dns or self.fixed)
                gone = self._replicas.pop(a)
                if gone.follower is not None:
                    gone.follower.stop()

    def _ejector(self, r: Replica) -> Callable[[str], None]:
        return lambda why: self.eject(r, f"its KV events: {why}")

    def close(self) -> None:
        """Stop following every replica's events."""
        for r in self.replicas:
            if r.follower is not None:
                r.follower.stop()

    def _maybe_resolve(self, now: float) -> None:
        if self.dns is None or now < self._next_resolve:
            return
        self._next_resolve = now + self.resolve_s
        try:
            self._refresh(self.resolver(*self.dns))
        except (OSError, ConfigError) as e:  # keep what we had; DNS may come back
            log.warning("resolving %s failed: %s", self.dns[0], e)

    def _usable(self, r: Replica, now: float) -> bool:
        if r.probed and r.ejected_until == 0.0:
            return True
        if r.ejected_until and now < r.ejected_until:
            return False
        healthy = self.probe(r.address)
        with self._lock:
            if healthy:
                if r.ejected_until:
                    log.warning("replica %s is back in rotation", r.address)
                r.probed, r.ejected_until = True, 0.0
            else:
                r.ejected_until = now + self.eject_s
        return healthy

    def choose(self, exclude: set[str] | frozenset[str] = frozenset()) -> Replica | None:
        """The least loaded usable replica not in `exclude`, or None."""
        choice = self.choose_for(None, exclude)
        return None if choice is None else choice.replica

    def choose_for(
        self, key: PromptKey | None, exclude: set[str] | frozenset[str] = frozenset()
    ) -> Choice | None:
        """The usable replica not in `exclude` that should serve `key` (by cost, when the
        route is cache-aware and the prompt is given; else the least loaded), or None."""
        now = self.clock()
        self._maybe_resolve(now)
        candidates = [r for r in self.replicas if r.address not in exclude and self._usable(r, now)]
        if not candidates:
            return None
        turn = next(self._turn)
        n = len(candidates)
        candidates.sort(key=lambda r: (r.order - turn) % n)  # ties in turn
        if key is None or self.route is None or not self.route.cache_aware:
            best = min(candidates, key=lambda r: self._load(r, now))
            return Choice(best, Held(0.0, 0))
        held = [r.cache.held(key) for r in candidates]
        scored = [self._candidate(r, h, now) for r, h in zip(candidates, held, strict=True)]
        i = pick(len(key), scored, self.route)
        best = candidates[i]
        with self._lock:
            best.prompt_tokens += len(key)
            best.held_tokens += round(held[i].expected)
        return Choice(best, held[i])

    def _candidate(self, r: Replica, held: Held, now: float) -> Candidate:
        if not self.decode:  # prefill: the work this frontend queued there
            return Candidate(held.expected, r.work_tokens)
        fresh = r.reported is not None and now - r.reported_at <= self.report_s
        load = r.cache.load(self.report_s)
        return decode_candidate(held.expected, load, r.reported if fresh else None, r.work_tokens)

    def _load(self, r: Replica, now: float) -> tuple[int, int, int]:
        """(waiting, busy, -free KV) of a replica: its own report while fresh (busy: at least
        what this frontend has on it), else this frontend's outstanding requests."""
        if r.reported is not None and now - r.reported_at <= self.report_s:
            running, waiting, _free_slots, free_kv = r.reported
            return waiting, max(running + waiting, r.outstanding), -free_kv
        return 0, r.outstanding, 0

    def report(
        self, replica: Replica, running: int, waiting: int, free: int, free_kv: int = -1
    ) -> None:
        replica.reported = (running, waiting, free, free_kv)
        replica.reported_at = self.clock()

    def eject(self, replica: Replica, why: str) -> None:
        replica.cache.reset()  # it may come back restarted: what it held is not known
        with self._lock:
            replica.failures += 1
            if replica.ejected_until == 0.0:
                replica.ejections += 1
                log.warning("replica %s out of rotation for %.0f s: %s", replica.address,
                            self.eject_s, why)  # fmt: skip
            replica.ejected_until = self.clock() + self.eject_s

    @contextlib.contextmanager
    def using(self, replica: Replica, work_tokens: int = 0) -> Iterator[Replica]:
        """A request in flight on `replica`, with `work_tokens` of work there (its load)."""
        with self._lock:
            replica.outstanding += 1
            replica.requests += 1
            replica.work_tokens += work_tokens
        if self.decode:  # (the KV it reserves there, until its heartbeat says so)
            replica.cache.shift(work_tokens)
        try:
            yield replica
        finally:
            with self._lock:
                replica.outstanding -= 1
                replica.work_tokens -= work_tokens
            if self.decode:
                replica.cache.shift(-work_tokens)
