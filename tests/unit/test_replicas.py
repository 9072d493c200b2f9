"""Replica choice, ejection, readmission and DNS discovery of remote pools (scripted probes
and a scripted resolver: no servers needed for the rules themselves)."""

from __future__ import annotations

import pytest

from disagg.errors import ConfigError
from disagg.remote.replicas import ReplicaSet, parse_spec
from disagg.serve.render import role_models

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_specs_parse_or_fail_clearly():
    assert parse_spec("a:1, b:2") == (["a:1", "b:2"], None)
    assert parse_spec("dns:prefill.ns.svc:8001") == ([], ("prefill.ns.svc", 8001))
    for bad in ("a", "a:x", "dns:nope"):
        with pytest.raises(ConfigError):
            parse_spec(bad)


def test_the_least_loaded_replica_is_chosen_and_ties_take_turns():
    rs = ReplicaSet("a:1,b:1,c:1", probe=lambda a: True)
    a, b, c = rs.replicas
    with rs.using(a), rs.using(a), rs.using(b):
        assert rs.choose() is c  # 0 outstanding
    picks = {rs.choose().address for _ in range(6)}
    assert picks == {"a:1", "b:1", "c:1"}  # all idle: in turn, not always the first


def test_a_failed_replica_leaves_rotation_and_comes_back_when_its_probe_passes():
    clock, healthy = Clock(), {"a:1": True, "b:1": True}
    rs = ReplicaSet("a:1,b:1", probe=lambda a: healthy[a], eject_s=2.0, clock=clock)
    a, b = rs.replicas
    rs.choose()  # both probed in
    rs.eject(a, "connection refused")
    assert all(rs.choose() is b for _ in range(5))
    healthy["a:1"] = False
    clock.now += 2.5  # ejection over, but the probe fails: still out, for another 2 s
    assert all(rs.choose() is b for _ in range(3)) and a.ejected_until > clock.now
    healthy["a:1"] = True
    clock.now += 2.5
    assert {rs.choose().address for _ in range(4)} == {"a:1", "b:1"}
    assert a.ejections == 1 and a.failures == 1


def test_no_replica_up_gives_none():
    rs = ReplicaSet("a:1", probe=lambda a: False)
    assert rs.choose() is None


def test_dns_is_reresolved_new_replicas_join_and_gone_ones_leave():
    clock, answers = Clock(), {"now": ["10.0.0.1:8001"]}
    rs = ReplicaSet(
        "dns:prefill.svc:8001",
        probe=lambda a: True,
        resolve_s=5.0,
        resolver=lambda name, port: answers["now"],
        clock=clock,
    )
    assert rs.choose().address == "10.0.0.1:8001"
    answers["now"] = ["10.0.0.1:8001", "10.0.0.2:8001"]
    clock.now += 1
    assert {r.address for r in rs.replicas} == {"10.0.0.1:8001"}  # not re-resolved yet
    clock.now += 5
    rs.choose()
    assert {r.address for r in rs.replicas} == {"10.0.0.1:8001", "10.0.0.2:8001"}
    answers["now"] = ["10.0.0.2:8001"]
    clock.now += 5
    assert rs.choose().address == "10.0.0.2:8001" and len(rs.replicas) == 1


def test_a_resolver_failure_keeps_the_replicas_known():
    clock = Clock()

    def resolver(name, port):
        if clock.now > 100:
            raise OSError("Name or service not known")
        return ["10.0.0.1:8001"]

    rs = ReplicaSet("dns:x:8001", probe=lambda a: True, resolver=resolver, clock=clock)
    rs.choose()
    clock.now += 10
    assert rs.choose().address == "10.0.0.1:8001"


def test_each_role_runs_its_models():
    assert role_models("prefill") == {"prefill"} and role_models("decode") == {"decode"}
    assert {"prefill", "decode", "router"} <= role_models("all", "a:1", "b:1")
    front = role_models("frontend", prefill_replicas="a:1")
    assert "prefill" not in front and {"decode", "orchestrator", "ensemble"} <= front


def test_a_replica_file_is_reread(tmp_path):
    from disagg.remote.replicas import resolve

    clock, path = Clock(), tmp_path / "prefill.txt"
    path.write_text("127.0.0.1:8001  # the first\n")
    rs = ReplicaSet(f"file:{path}", probe=lambda a: True, resolve_s=5.0, clock=clock)
    assert rs.choose().address == "127.0.0.1:8001"
    path.write_text("127.0.0.1:8001\n127.0.0.1:8011\n")
    clock.now += 6
    assert {rs.choose().address for _ in range(4)} == {"127.0.0.1:8001", "127.0.0.1:8011"}
    path.write_text("not an address\n")
    clock.now += 6
    assert len(rs.replicas) == 2  # a broken file keeps what was known
    with pytest.raises(ConfigError):
        resolve(f"file:{path}", 0)


def test_decode_replicas_are_chosen_by_the_load_they_report_while_it_is_fresh():
    clock = Clock()
    rs = ReplicaSet("a:1,b:1", probe=lambda a: True, clock=clock, report_s=2.0)
    a, b = rs.replicas
    rs.report(a, running=7, waiting=0, free=1)  # other frontends keep it busy
    rs.report(b, running=2, waiting=0, free=6)
    assert all(rs.choose() is b for _ in range(4))
    rs.report(b, running=8, waiting=3, free=0)  # now b queues sequences
    assert rs.choose() is a
    rs.report(a, running=4, waiting=0, free=4, free_kv=900)
    rs.report(b, running=4, waiting=0, free=4, free_kv=5000)
    assert rs.choose() is b  # as busy: the one with more KV cache free
    clock.now += 3  # reports gone stale: this frontend's own counts decide
    with rs.using(b):
        assert rs.choose() is a
