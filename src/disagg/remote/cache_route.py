"""Cache-aware replica choice: which replica of a remote pool serves a prompt, by the prefix
blocks each one holds and by its load. No Triton, no torch.

Design note. Every replica keeps a prefix cache of its own (engine/prefix_cache.py). A
frontend's view of it (`ReplicaCache`) comes from what the replica itself sends: the KV
events of each of its instances (kvevents.py: blocks stored and evicted, an epoch per
process start, a heartbeat with its load), followed over one connection per instance and
never asked per request. Where a replica publishes no events (`kv_events_port` 0, an older
server) the view is this frontend's own record of what it sent there, as in Dynamo's
router without events: an estimate, forgotten when the replica fails.

A replica is chosen per request by cost, as Dynamo's KV router scores its workers
(`overlap weight x prefill blocks + active blocks`):

    cost(r) = (P - H(r)) + w * W(r)        the replica of least cost serves; ties in turn

    P     the prompt's blocks: ceil(prompt tokens / B), B the block size (16 tokens)
    H(r)  leading prompt blocks r holds in the request's namespace (the per-key salt is in
          every hash, so one key's blocks never match another's), averaged over r's
          instances (Triton picks the instance); 0 while r is overloaded
    W(r)  work already on r, in blocks:
            prefill  the blocks still to compute of the prompts this frontend has in flight
                     there: what r computes before this prompt
            decode   the KV blocks its sequences hold, from its heartbeat (every frontend's
                     sequences), at least what this frontend has in flight there (prompt +
                     max_tokens of each)
    w     replica_load_weight (0.5: a block queued weighs half a block to compute)

With w = 1, for prefill, cost is in blocks of prefill work the wait for this prompt's first
token. But a block a replica computes for want of a cache delays every prompt queued after
it too, not this one alone, so w is below 1: measured on the multi-turn workload
(docs/benchmarks.md, "Cache-aware replica choice"), w = 1 moved conversations whenever one
more turn was queued at home (77% of prompt tokens cached, one server: 84%), w = 0.5 kept
them (83%). A conversation stays on the replica holding its earlier turns until the work
queued there is worth twice what its cache saves; then it moves, and its next turn finds it
on the new replica.

Overloaded: a decode replica with sequences waiting for a slot, or whose slots or KV blocks
are at least `replica_overload` (0.9) in use. Its cache is not counted (H = 0): it keeps no
conversation and gets a request only when it is still cheapest by load alone. (A prefill
replica has no such threshold: the work queued on it is its load term.)
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg.engine.prefix_cache import BlockHash, block_hashes, root_hash
from disagg.kvevents import STORED, Subscriber

CACHE_AWARE, LOAD = "cache_aware", "load"
CHOICES = (CACHE_AWARE, LOAD)
_OWN_ROOT = root_hash("frontend-record", "", 16)  # the own record's hashes: this frontend's


@dataclass(frozen=True)
class RouteParams:
    choice: str = CACHE_AWARE  # or LOAD: by load alone (the reports), blind to caches
    load_weight: float = 0.5  # w
    overload: float = 0.9  # a decode replica this full keeps no conversation
    block_size: int = 16
    capacity_tokens: int = 16384  # a replica's prefix cache: bounds the own record
    events: bool = True  # follow the KV events of replicas that publish them

    @property
    def cache_aware(self) -> bool:
        return self.choice == CACHE_AWARE


class PromptKey:
    """A prompt in its cache namespace; its block hashes computed once per root."""

    def __init__(self, token_ids: Sequence[int], salt: str = "") -> None:
        self.token_ids = token_ids
        self.salt = salt
        self._hashes: dict[tuple[BlockHash, int], list[BlockHash]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def hashes(self, root: BlockHash, block_size: int) -> list[BlockHash]:
        got = self._hashes.get((root, block_size))
        if got is None:
            got = block_hashes(root, self.token_ids, block_size, self.salt)
            self._hashes[(root, block_size)] = got
        return got


def _leading(hashes: list[BlockHash], held: Any) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n


class InstanceView:
    """One instance's prefix cache as its KV events tell it (a kvevents.Sink)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_beat: Callable[[], None] = lambda: None,
    ) -> None:
        self.clock = clock
        self.on_beat = on_beat  # a heartbeat arrived (ReplicaCache.beat)
        self.epoch = ""
        self.root = b""
        self.block_size = 16
        self.blocks: set[BlockHash] = set()
        self.live = False
        self.load: dict[str, Any] = {}
        self.load_at = 0.0
        self.restarts = 0  # epochs seen after the first: the instance restarted
        self.evicted = 0  # blocks its events said it evicted
        self._lock = threading.Lock()

    def hello(self, message: dict[str, Any]) -> None:
        with self._lock:
            if self.epoch and message["epoch"] != self.epoch:
                self.restarts += 1
            self.epoch = str(message["epoch"])
            self.root = bytes.fromhex(message["root"])
            self.block_size = int(message["block_size"])
            self.blocks = set()

    def snapshot(self, blocks: list[bytes]) -> None:
        with self._lock:
            self.blocks, self.live = set(blocks), True

    def event(self, kind: str, blocks: list[bytes]) -> None:
        with self._lock:
            if kind == STORED:
                self.blocks.update(blocks)
            else:
                self.blocks.difference_update(blocks)
                self.evicted += len(blocks)

    def heartbeat(self, load: dict[str, Any]) -> None:
        self.load, self.load_at = load, self.clock()
        self.on_beat()

    def lost(self, why: str) -> None:
        with self._lock:
            self.blocks, self.live, self.load = set(), False, {}

    def held_tokens(self, key: PromptKey) -> int:
        """Leading tokens of `key` whose blocks this instance holds."""
        with self._lock:
            if not self.live or not self.root:
                return 0
            return _leading(key.hashes(self.root, self.block_size), self.blocks) * self.block_size


@dataclass(frozen=True)
class Held:
    expected: float  # leading prompt tokens the replica holds, averaged over its instances
    sure: int  # ... that whichever instance serves holds (what a hand-off may leave out)


class ReplicaCache:
    """What one replica's prefix caches hold, as this frontend knows it: its instances'
    events while any is followed, else this frontend's own record of what it sent there."""

    def __init__(self, capacity_tokens: int = 16384, block_size: int = 16) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self.views: list[InstanceView] = []
        self.instances: int | None = None  # its instance count, once discovered
        self._record: OrderedDict[BlockHash, None] = OrderedDict()
        # KV tokens this frontend's requests reserved (+) and released (-) there since its
        # last heartbeat: its own changes count at once, not a heartbeat later
        self._since_beat = 0
        self._lock = threading.Lock()

    def view(self) -> InstanceView:
        """A new instance view whose heartbeats are this replica's."""
        return InstanceView(on_beat=self.beat)

    def beat(self) -> None:
        with self._lock:
            self._since_beat = 0

    def shift(self, kv_tokens: int) -> None:
        """This frontend's request reserved (> 0) or released (< 0) KV tokens there."""
        with self._lock:
            self._since_beat += kv_tokens

    @property
    def following(self) -> bool:
        return any(v.live for v in self.views)

    def held(self, key: PromptKey) -> Held:
        if self.following:
            counts = [v.held_tokens(key) for v in self.views]
            return Held(sum(counts) / len(counts), min(counts))
        with self._lock:
            n = _leading(key.hashes(_OWN_ROOT, self.block_size), self._record) * self.block_size
        return Held(float(n), n if self.instances == 1 else 0)

    def record(self, key: PromptKey) -> None:
        """The replica now holds `key`'s full blocks (by this frontend's own account, which
        is used only while no event stream says better)."""
        if self.following or self.capacity_blocks == 0:
            return
        hashes = key.hashes(_OWN_ROOT, self.block_size)
        with self._lock:
            for h in reversed(hashes):  # the chain's head last: the last to be forgotten
                self._record[h] = None
                self._record.move_to_end(h)
            while len(self._record) > self.capacity_blocks:
                self._record.popitem(last=False)

    def forget(self, key: PromptKey) -> None:
        """The replica said it lacks `key`'s blocks (a prefix miss)."""
        with self._lock:
            for h in key.hashes(_OWN_ROOT, self.block_size):
                self._record.pop(h, None)

    def reset(self) -> None:
        """The replica failed or restarted: nothing recorded of it holds any more."""
        with self._lock:
            self._record.clear()

    @property
    def num_evicted(self) -> int:
        """Blocks its instances evicted since this frontend follows them (their events)."""
        return sum(v.evicted for v in self.views)

    @property
    def num_blocks(self) -> int:
        if self.following:
            return sum(len(v.blocks) for v in self.views if v.live)
        return len(self._record)

    def load(self, max_age_s: float) -> dict[str, int] | None:
        """Its decode load summed over instances, from heartbeats younger than max_age_s;
        None when an instance's is missing or stale (or this is not a decode replica)."""
        if not self.views:
            return None
        now = self.views[0].clock()
        loads = [v.load for v in self.views if v.live and now - v.load_at <= max_age_s]
        if len(loads) != len(self.views) or not all("slots" in x for x in loads):
            return None
        keys = [k for k, v in loads[0].items() if isinstance(v, int)]
        load = {k: sum(int(x.get(k, 0)) for x in loads) for k in keys}
        if "kv_used_tokens" in load:
            with self._lock:
                load["kv_used_tokens"] = max(load["kv_used_tokens"] + self._since_beat, 0)
        return load


# ------------------------------------------------------------------ the choice, from numbers


@dataclass(frozen=True)
class Candidate:
    held_tokens: float  # H, in tokens
    work_tokens: float  # W, in tokens
    utilisation: float = 0.0  # decode: max(slots, KV) in use, 0..1
    waiting: int = 0  # decode: sequences waiting for a slot


def overloaded(c: Candidate, threshold: float) -> bool:
    return c.waiting > 0 or c.utilisation >= threshold


def cost(prompt_tokens: int, c: Candidate, params: RouteParams) -> float:
    """The design note's cost(r), in blocks."""
    b = params.block_size
    blocks = math.ceil(prompt_tokens / b)
    held = 0.0 if overloaded(c, params.overload) else min(c.held_tokens / b, blocks)
    return (blocks - held) + params.load_weight * c.work_tokens / b


def pick(prompt_tokens: int, candidates: Sequence[Candidate], params: RouteParams) -> int:
    """Index of the cheapest candidate; of equals, one not overloaded, then the first (the
    caller orders them by turn)."""
    keys = [(cost(prompt_tokens, c, params), overloaded(c, params.overload)) for c in candidates]
    return keys.index(min(keys))


def decode_candidate(
    held: float, load: dict[str, int] | None, report: tuple[int, int, int, int] | None, work: int
) -> Candidate:
    """A decode replica's numbers: its heartbeat when fresh, else its last response's report
    (running, waiting, free slots, free KV), else only this frontend's work there."""
    if load is not None:
        slots, capacity = max(load["slots"], 1), max(load.get("kv_capacity_tokens", 0), 1)
        used = load.get("kv_used_tokens", 0)
        util = max(load.get("running", 0) / slots, used / capacity if capacity > 1 else 0.0)
        return Candidate(held, max(used, work), util, load.get("waiting", 0))
    if report is not None:
        running, waiting, free_slots, _free_kv = report
        return Candidate(held, work, running / max(running + free_slots, 1), waiting)
    return Candidate(held, work)


# ------------------------------------------------------------------ following a replica


@dataclass
class Follower:
    """Finds where a replica publishes its KV events (`discover(address)`: (port, instance
    count), or None while it does not answer) and follows each of its instances, port + i.
    Port 0: it publishes none; the own record stands."""

    address: str
    cache: ReplicaCache
    discover: Callable[[str], tuple[int, int] | None]
    token: str
    on_lost: Callable[[str], None]
    retry_s: float = 1.0
    subscribers: list[Subscriber] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Follower:
        threading.Thread(target=self._run, name=f"follow {self.address}", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            found = self.discover(self.address)
            if found is not None:
                break
            self._stop.wait(self.retry_s)
        else:
            return
        port, instances = found
        self.cache.instances = instances
        if not port or self._stop.is_set():
            return
        host = self.address.rpartition(":")[0]
        views = [self.cache.view() for _ in range(instances)]
        self.cache.views = views
        for i, view in enumerate(views):
            sub = Subscriber(f"{host}:{port + i}", self.token, view, self.on_lost)
            self.subscribers.append(sub.start())

    def stop(self) -> None:
        self._stop.set()
        for sub in self.subscribers:
            sub.stop()
