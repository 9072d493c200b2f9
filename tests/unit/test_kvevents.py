"""KV cache events over TCP on loopback: a real Publisher over a prefix cache index (plain
numbers, no weights) and a real Subscriber feeding a frontend's view of it. What the cache
stores and evicts reaches the view in order; a wrong token, a publisher that dies or goes
silent, a restart (a new epoch) and a subscriber that fell behind the log all end as the
design note says, each within a second."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from disagg import kvevents
from disagg.engine.prefix_cache import PrefixCache, block_hashes, root_hash
from disagg.kvevents import EventLog, Publisher, Subscriber
from disagg.remote.cache_route import InstanceView, PromptKey

pytestmark = pytest.mark.unit
TOKEN = "internal-token"
BS = 4
ROOT = root_hash("fp", "float32", BS)


class Cache:
    """What KVReuse gives a publisher, over the real index (engine/kv_reuse.py)."""

    def __init__(self, num_blocks: int = 8) -> None:
        self.index = PrefixCache(num_blocks, BS)
        self.root = ROOT
        self.lock = threading.Lock()

    def publish(self, on_event):
        self.index.on_event = on_event

    def snapshot(self, seq):
        with self.lock:
            return seq(), self.index.hashes()

    def store(self, tokens, salt=""):
        with self.lock:
            self.index.allocate(block_hashes(ROOT, tokens, BS, salt))


def eventually(check, timeout_s: float = 1.0) -> float:
    """Seconds until check() holds (fails past timeout_s)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout_s, "not within the time allowed"
        time.sleep(0.005)
    return time.monotonic() - start


@pytest.fixture
def cache():
    return Cache()


@pytest.fixture
def publisher(cache):
    pub = Publisher(cache, TOKEN, pool="decode", block_size=BS, heartbeat_s=0.05).start()
    yield pub
    pub.close()


def follow(pub: Publisher, token: str = TOKEN, **kw) -> tuple[InstanceView, Subscriber]:
    view = InstanceView()
    sub = Subscriber(f"127.0.0.1:{pub.port}", token, view, retry_s=0.05, **kw).start()
    return view, sub


def test_stored_and_evicted_blocks_reach_the_view_in_order(cache, publisher):
    cache.store(list(range(8)))  # before the subscriber: in its snapshot
    view, sub = follow(publisher)
    try:
        eventually(lambda: view.live)
        first = PromptKey(list(range(8)) + [50])
        assert view.held_tokens(first) == 8
        cache.store(list(range(100, 128)))  # 7 more blocks into 8: the oldest goes
        other = PromptKey(list(range(100, 128)))
        eventually(lambda: view.held_tokens(other) == 28)
        # the first chain lost its head: nothing of it matches any more
        assert view.held_tokens(first) == 0 and len(view.blocks) == 8
        assert view.blocks == set(cache.index.hashes())
    finally:
        sub.stop()


def test_an_eviction_of_the_chain_being_stored_keeps_the_view_exact():
    """A chain longer than the cache evicts its own first blocks while it is stored: the
    events say so in that order, so the view holds what the cache holds."""
    cache = Cache(num_blocks=3)
    seen = []
    cache.index.on_event = lambda kind, hashes: seen.append((kind, len(hashes)))
    cache.store(list(range(20)))  # 5 blocks into 3
    assert seen == [("stored", 3), ("removed", 1), ("stored", 1), ("removed", 1), ("stored", 1)]
    pub = Publisher(cache, TOKEN, pool="prefill", block_size=BS).start()
    view, sub = follow(pub)
    try:
        cache.store(list(range(40, 60)))
        eventually(lambda: view.live and view.blocks == set(cache.index.hashes()))
    finally:
        sub.stop()
        pub.close()


def test_a_salted_prompt_matches_only_its_own_namespace(cache, publisher):
    cache.store(list(range(16)), salt="key-a")
    view, sub = follow(publisher)
    try:
        eventually(lambda: view.live)
        assert view.held_tokens(PromptKey(list(range(16)), "key-a")) == 16
        assert view.held_tokens(PromptKey(list(range(16)), "key-b")) == 0
        assert view.held_tokens(PromptKey(list(range(16)))) == 0
    finally:
        sub.stop()


def test_a_wrong_token_learns_nothing(cache, publisher):
    cache.store(list(range(8)))
    view, sub = follow(publisher, token="not-the-token")
    try:
        time.sleep(0.3)
        assert not view.live and view.blocks == set()
    finally:
        sub.stop()


def test_a_publisher_that_dies_is_forgotten_at_once_and_a_restart_starts_empty(cache):
    pub = Publisher(cache, TOKEN, pool="decode", block_size=BS, heartbeat_s=0.05).start()
    port, lost = pub.port, []
    cache.store(list(range(8)))
    view, sub = follow(pub, on_lost=lost.append)
    try:
        eventually(lambda: view.live and view.blocks)
        epoch = view.epoch
        pub.close()  # as when the process exits: its connections close with it
        took = eventually(lambda: not view.live and lost)
        assert took < 1.0 and view.blocks == set()
        restarted = Publisher(Cache(), TOKEN, pool="decode", block_size=BS, port=port).start()
        try:
            eventually(lambda: view.live, timeout_s=2.0)
            assert view.epoch != epoch and view.restarts == 1 and view.blocks == set()
        finally:
            restarted.close()
    finally:
        sub.stop()


def test_a_silent_publisher_is_given_up_within_a_second():
    """A host that vanishes sends no FIN: silence past timeout_s ends the stream."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    hello = {"t": "hello", "epoch": "01", "root": ROOT.hex(), "block_size": BS}

    def silent():
        conn, _ = server.accept()
        conn.recv(36)
        kvevents.send_frame(conn, hello)
        kvevents.send_frame(conn, {"t": "snapshot", "seq": 0, "blocks": [ROOT.hex()]})
        time.sleep(3)  # then nothing, not even a heartbeat
        conn.close()

    threading.Thread(target=silent, daemon=True).start()
    view, lost = InstanceView(), []
    sub = Subscriber(f"127.0.0.1:{port}", TOKEN, view, on_lost=lost.append, timeout_s=0.5)
    sub.start()
    try:
        eventually(lambda: view.live)
        took = eventually(lambda: lost, timeout_s=1.0)
        assert 0.3 < took < 1.0 and not view.live and view.blocks == set()
    finally:
        sub.stop()
        server.close()


def test_heartbeats_carry_the_load_and_a_nudge_sends_it_at_once(cache):
    load = {"running": 3, "waiting": 0, "slots": 8}
    pub = Publisher(cache, TOKEN, pool="decode", load=lambda: load, heartbeat_s=0.05).start()
    view, sub = follow(pub)
    try:
        eventually(lambda: view.load.get("running") == 3)
        load = {"running": 5, "waiting": 1, "slots": 8}
        eventually(lambda: view.load.get("waiting") == 1)
    finally:
        sub.stop()
        pub.close()
    slow = Publisher(cache, TOKEN, pool="decode", load=lambda: load, heartbeat_s=30.0).start()
    view, sub = follow(slow, timeout_s=60.0)
    try:
        eventually(lambda: view.load.get("running") == 5)  # the first one, at once
        load = {"running": 0, "waiting": 0, "slots": 8}
        slow.nudge()  # a sequence left: no waiting 30 s for the heartbeat
        assert eventually(lambda: view.load.get("running") == 0) < 0.5
    finally:
        sub.stop()
        slow.close()


def test_the_log_says_when_a_cursor_fell_behind():
    log = EventLog(max_events=4)
    for i in range(6):
        log.append("stored", [bytes([i]) * 16])
    assert log.since(6, timeout_s=0.0) == []
    assert [seq for seq, _, _ in log.since(3, timeout_s=0.0)] == [4, 5, 6]
    assert log.since(1, timeout_s=0.0) is None  # events 2 and 3 are gone: a snapshot
    woke = []
    t = threading.Thread(target=lambda: woke.append(log.since(6, timeout_s=2.0)))
    t.start()
    time.sleep(0.05)
    log.append("removed", [b"\0" * 16])
    t.join(1.0)
    assert woke and woke[0][0][:2] == (7, "removed")


def test_a_subscriber_that_falls_behind_gets_a_snapshot(cache):
    pub = Publisher(cache, TOKEN, pool="prefill", max_events=2, heartbeat_s=0.05).start()
    view, sub = follow(pub)
    try:
        eventually(lambda: view.live)
        with cache.lock:  # many events at once, more than the log keeps
            for i in range(10):
                cache.index.allocate(block_hashes(ROOT, [i] * BS, BS))
        eventually(lambda: view.blocks == set(cache.index.hashes()))
    finally:
        sub.stop()
        pub.close()


def test_the_instance_index_comes_from_tritons_instance_name():
    assert kvevents.instance_index("decode_0_1") == 1
    assert kvevents.instance_index("prefill_0") == 0
    assert kvevents.instance_index("") == 0
    assert kvevents.publish(None, TOKEN, pool="decode", instance_name="decode_0_0",
                            host="127.0.0.1", port=9, block_size=BS,
                            capacity_blocks=1) is None  # fmt: skip
