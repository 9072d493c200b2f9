"""Cache-aware replica choice from plain numbers (remote/cache_route.py's design note): the
cost of each replica, what overloaded means, the frontend's view of a replica's cache (its
events, or this frontend's own record), and ReplicaSet choosing by them: a conversation
keeps landing where its KV is until that replica is overloaded or restarts."""

from __future__ import annotations

import pytest

from disagg.engine.prefix_cache import block_hashes, root_hash
from disagg.remote.cache_route import (
    Candidate,
    Held,
    InstanceView,
    PromptKey,
    ReplicaCache,
    RouteParams,
    cost,
    decode_candidate,
    overloaded,
    pick,
)
from disagg.remote.replicas import ReplicaSet

pytestmark = pytest.mark.unit
P = RouteParams(load_weight=1.0)  # block size 16, overload 0.9
ROOT = root_hash("fp", "float32", 16)


def test_cost_is_blocks_to_compute_plus_the_work_queued_there():
    # 160 tokens: 10 blocks; A holds 8 of them, B none
    a, b = Candidate(held_tokens=128, work_tokens=0), Candidate(held_tokens=0, work_tokens=0)
    assert cost(160, a, P) == 2 and cost(160, b, P) == 10
    assert pick(160, [b, a], P) == 1
    # 200 tokens of work queued on A (12.5 blocks) outweigh the 8 blocks it saves
    busy = Candidate(held_tokens=128, work_tokens=200)
    assert cost(160, busy, P) == 14.5 and pick(160, [busy, b], P) == 1
    # a partial last block counts as a block; a replica never holds more than the prompt
    assert cost(17, Candidate(held_tokens=64, work_tokens=0), P) == 0
    assert cost(17, Candidate(held_tokens=0, work_tokens=0), P) == 2
    # the load weight scales the work (0.5 by default: queued work weighs half)
    assert RouteParams().load_weight == 0.5
    assert cost(160, busy, RouteParams()) == 2 + 6.25


def test_ties_go_to_the_first_candidate_the_caller_put_first():
    same = [Candidate(0, 0), Candidate(0, 0), Candidate(0, 0)]
    assert pick(50, same, P) == 0


def test_an_overloaded_replica_keeps_no_conversation():
    full = Candidate(held_tokens=160, work_tokens=0, utilisation=0.95)
    waiting = Candidate(held_tokens=160, work_tokens=0, waiting=1)
    idle = Candidate(held_tokens=0, work_tokens=0)
    for c in (full, waiting):
        assert overloaded(c, 0.9) and cost(160, c, P) == 10
    assert not overloaded(Candidate(160, 0, utilisation=0.85), 0.9)
    # it still serves when it is the cheapest by load alone (everyone else busier)
    busier = Candidate(held_tokens=0, work_tokens=64)
    assert pick(160, [busier, full], P) == 1 and pick(160, [idle, full], P) == 0


def test_a_decode_candidate_comes_from_its_heartbeat_else_its_report_else_own_work():
    beat = {"running": 4, "waiting": 0, "slots": 8, "kv_used_tokens": 900,
            "kv_capacity_tokens": 1000}  # fmt: skip
    c = decode_candidate(32.0, beat, None, work=100)
    assert (c.held_tokens, c.work_tokens, c.utilisation, c.waiting) == (32.0, 900, 0.9, 0)
    assert overloaded(c, 0.9)  # its KV is 90% reserved
    c = decode_candidate(0.0, None, (7, 0, 1, -1), work=50)  # running, waiting, free slots
    assert (c.work_tokens, c.utilisation) == (50, 7 / 8)
    c = decode_candidate(0.0, None, None, work=50)
    assert (c.work_tokens, c.utilisation, c.waiting) == (50, 0.0, 0)


def test_a_prompt_key_hashes_once_per_root_and_keeps_its_salt():
    key = PromptKey(list(range(40)), "key-a")
    assert key.hashes(ROOT, 16) == block_hashes(ROOT, list(range(40)), 16, "key-a")
    assert key.hashes(ROOT, 16) is key.hashes(ROOT, 16)
    assert key.hashes(ROOT, 16) != PromptKey(list(range(40)), "key-b").hashes(ROOT, 16)


def _view(blocks_of: list[int], salt: str = "", epoch: str = "e1") -> InstanceView:
    view = InstanceView()
    view.hello({"epoch": epoch, "root": ROOT.hex(), "block_size": 16})
    view.snapshot(block_hashes(ROOT, blocks_of, 16, salt))
    return view


def test_a_replica_followed_by_events_holds_what_its_instances_hold():
    cache = ReplicaCache()
    cache.views = [_view(list(range(64))), _view(list(range(32)))]
    key = PromptKey(list(range(64)) + [7])
    assert cache.following
    # Triton picks the instance: expect the mean; a hand-off may skip only what both hold
    assert cache.held(key) == Held(48.0, 32)
    assert cache.held(PromptKey(list(range(64)), "other-key")) == Held(0.0, 0)
    cache.record(PromptKey(list(range(500, 600))))  # ignored: the events say better
    assert cache.held(PromptKey(list(range(500, 600)))).expected == 0
    cache.views[1].lost("connection reset")  # an instance gone: it holds nothing
    assert cache.held(key) == Held(32.0, 0)
    cache.views[0].lost("connection reset")
    assert not cache.following and cache.held(key) == Held(0.0, 0)


def test_a_restart_is_a_new_epoch_with_nothing_held():
    view = _view(list(range(32)))
    view.hello({"epoch": "e2", "root": ROOT.hex(), "block_size": 16})
    view.snapshot([])
    assert view.restarts == 1 and view.held_tokens(PromptKey(list(range(32)))) == 0


def test_without_events_the_own_record_stands_bounded_and_forgettable():
    cache = ReplicaCache(capacity_tokens=64)  # 4 blocks
    first = PromptKey(list(range(48)))
    cache.record(first)
    assert cache.held(first) == Held(48.0, 0)  # instance count unknown: nothing is sure
    cache.instances = 1
    assert cache.held(first) == Held(48.0, 48)
    cache.record(PromptKey(list(range(100, 132))))  # 2 more blocks: the oldest goes
    assert cache.held(first).expected < 48 and cache.num_blocks == 4
    cache.forget(PromptKey(list(range(100, 132))))
    assert cache.held(PromptKey(list(range(100, 132)))).expected == 0
    cache.reset()
    assert cache.num_blocks == 0


def test_the_load_of_a_replica_is_its_instances_heartbeats_while_fresh():
    now = [10.0]
    cache = ReplicaCache()
    cache.views = [InstanceView(clock=lambda: now[0], on_beat=cache.beat) for _ in range(2)]
    for v in cache.views:
        v.snapshot([])
        v.heartbeat({"running": 2, "waiting": 0, "slots": 8, "kv_used_tokens": 100})
    assert cache.load(max_age_s=2.0) == {"running": 4, "waiting": 0, "slots": 16,
                                         "kv_used_tokens": 200}  # fmt: skip
    now[0] += 3.0
    assert cache.load(max_age_s=2.0) is None  # stale
    # this frontend's own requests count at once, until the next heartbeat says
    cache.shift(+300)
    now[0] -= 3.0
    assert cache.load(max_age_s=2.0)["kv_used_tokens"] == 500
    cache.shift(-500)  # its requests ended (before the heartbeat that shows it)
    assert cache.load(max_age_s=2.0)["kv_used_tokens"] == 0
    cache.views[0].heartbeat({"running": 0, "waiting": 0, "slots": 8, "kv_used_tokens": 0})
    assert cache.load(max_age_s=2.0)["kv_used_tokens"] == 100  # (the other's, as it said)
    prefill = ReplicaCache()
    prefill.views = [InstanceView()]
    prefill.views[0].snapshot([])
    prefill.views[0].heartbeat({})
    assert prefill.load(max_age_s=2.0) is None  # a prefill instance reports no load


# ------------------------------------------------------------------ ReplicaSet, by numbers


def conversation(turn: int) -> list[int]:
    """A chat's prompt at `turn`: the earlier turns, then 40 new tokens."""
    return list(range(1000, 1000 + 40 * (turn + 1)))


def replicas(choice: str = "cache_aware", decode: bool = False) -> ReplicaSet:
    return ReplicaSet("a:1,b:1", probe=lambda a: True, route=RouteParams(choice=choice),
                      decode=decode)  # fmt: skip


def test_a_conversation_keeps_landing_where_its_kv_is():
    rs = replicas()
    served = []
    for turn in range(5):
        key = PromptKey(conversation(turn))
        choice = rs.choose_for(key)
        served.append(choice.replica.address)
        choice.replica.cache.record(key)  # what the pool records after a prefill there
    assert len(set(served)) == 1
    other = rs.choose_for(PromptKey(list(range(5000, 5100))))  # a new prompt: the idle one
    assert other.replica.address != served[0]
    a = next(r for r in rs.replicas if r.address == served[0])
    assert a.held_tokens > 0 and a.prompt_tokens > a.held_tokens  # counted for the metrics


def test_a_conversation_leaves_a_replica_whose_queue_outweighs_its_cache():
    rs = replicas()  # queued work weighs half a block to compute
    key = PromptKey(conversation(3))  # 160 tokens: 10 blocks
    home = rs.choose_for(key).replica
    home.cache.record(PromptKey(conversation(2)))  # holds 7 of its 10 blocks
    with rs.using(home, work_tokens=160):  # 10 blocks queued: still worth waiting for
        assert rs.choose_for(key).replica is home
    with rs.using(home, work_tokens=320):  # 20 blocks queued: worth more than it saves
        assert rs.choose_for(key).replica is not home


def test_an_overloaded_decode_replica_loses_its_conversations():
    rs = replicas(decode=True)
    key = PromptKey(conversation(3))
    home = rs.choose_for(key).replica
    home.cache.record(key)
    assert rs.choose_for(key).replica is home
    rs.report(home, running=2, waiting=1, free=0)  # sequences wait for a slot there
    assert rs.choose_for(key).replica is not home
    rs.report(home, running=2, waiting=0, free=6)
    assert rs.choose_for(key).replica is home


def test_load_choice_is_blind_to_caches():
    rs = replicas(choice="load")
    key = PromptKey(conversation(3))
    picks = set()
    for _ in range(4):
        choice = rs.choose_for(key)
        choice.replica.cache.record(key)
        assert choice.held == Held(0.0, 0)
        picks.add(choice.replica.address)
    assert picks == {"a:1", "b:1"}  # in turn, as before


def test_an_ejected_replica_is_forgotten():
    rs = replicas()
    key = PromptKey(conversation(3))
    home = rs.choose_for(key).replica
    home.cache.record(key)
    rs.eject(home, "connection refused")
    assert home.cache.num_blocks == 0
    assert rs.choose_for(key).replica is not home
