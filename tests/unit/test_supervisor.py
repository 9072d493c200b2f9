"""The stub supervisor's decisions, from scripted process counts and model states."""

import subprocess
import time
from collections import Counter

import pytest

from disagg.serve import supervisor as sup

pytestmark = pytest.mark.unit


class Scripted(sup.StubSupervisor):
    """Process counts, model states and instance counts as the test sets them; reloads and
    server restarts are recorded, not done."""

    def __init__(self, monkeypatch, instances=None, interval_s=1.0, stubs=None):
        self.wedged_calls: list[str] = []
        super().__init__(
            server_pid=1,
            http_url="http://127.0.0.1:1",
            admin_header="k",
            admin_key="v",
            interval_s=interval_s,
            recover_timeout_s=60.0,
            on_wedged=self.wedged_calls.append,
        )
        self.live: Counter = Counter()
        self.ready: set[str] = set()
        self.instances = instances or {}
        self.reloaded: list[str] = []
        stubs = stubs or (lambda: {-i: (m, "") for i, m in enumerate(self.live.elements())})
        monkeypatch.setattr(sup, "stub_processes", lambda pid: stubs())

    def _ready_models(self):
        return self.ready

    def _instances(self, model):
        return self.instances.get(model, self.live[model])

    def _start_reload(self, model):
        self.reloaded.append(model)


def test_a_stub_that_dies_is_restarted_at_the_next_check(monkeypatch):
    s = Scripted(monkeypatch)
    s.ready, s.live = {"decode", "ensemble"}, Counter(decode=2)
    s.check()
    assert s.expected == Counter(decode=2)  # ensembles have no stub and are not tracked
    s.live = Counter(decode=1)  # one fewer than a second ago: a death, not a load
    s.check()
    assert s.reloaded == ["decode"]


def test_a_model_short_of_stubs_from_the_start_is_restarted_after_two_checks(monkeypatch):
    s = Scripted(monkeypatch, instances={"decode": 2})
    s.ready, s.live = {"decode"}, Counter(decode=1)
    s.check()
    s.check()
    assert s.reloaded == []  # one short check may be a load in progress
    s.check()
    assert s.reloaded == ["decode"]


def test_a_model_an_operator_unloaded_is_left_alone(monkeypatch):
    s = Scripted(monkeypatch)
    s.ready, s.live = {"prefill"}, Counter(prefill=1)
    s.check()
    s.ready, s.live = set(), Counter()  # unloaded through the admin API
    s.check()
    s.check()
    assert s.reloaded == [] and "prefill" not in s.expected
    s.ready, s.live = {"prefill"}, Counter(prefill=3)  # loaded again, with more instances
    s.check()
    assert s.expected["prefill"] == 3 and s.reloaded == []


def test_a_stub_that_died_before_the_first_check_is_counted_from_the_config(monkeypatch):
    s = Scripted(monkeypatch, instances={"decode": 1})
    s.ready, s.live = {"decode"}, Counter()  # its only stub died before anyone looked
    s.check(now=0)
    assert s.expected == Counter(decode=1)
    s.check(now=1)
    s.check(now=2)
    assert s.reloaded == ["decode"]


def test_a_reload_that_brings_every_stub_back_ends_the_recovery(monkeypatch):
    s = Scripted(monkeypatch)
    s.ready, s.live = {"decode"}, Counter(decode=1)
    s.check(now=0)
    s.live = Counter()
    s.check(now=1)
    s.check(now=2)
    assert s.recovering == {"decode": 61.0}  # from the check that saw it gone
    s.ready = set()  # unloading, then LOADING: not an operator's unload, still ours
    s.check(now=3)
    assert "decode" in s.expected and s.reloaded == ["decode"]
    s.ready, s.live = {"decode"}, Counter(decode=1)
    s.check(now=20)
    assert s.recovering == {} and s.num_restarts == 1 and s.wedged is None
    assert s.wedged_calls == []


def test_a_wedged_reload_restarts_the_server_once(monkeypatch):
    s = Scripted(monkeypatch)
    s.ready, s.live = {"decode", "prefill"}, Counter(decode=1, prefill=1)
    s.check(now=0)
    s.live = Counter(prefill=1)
    s.check(now=1)
    s.check(now=2)
    s.ready = {"prefill"}  # decode stays LOADING: its new stub hangs in its start
    s.check(now=61)
    assert s.wedged_calls == [] and s.wedged is None  # 60 s in: still waiting
    s.check(now=63)
    assert s.wedged_calls == ["decode"] and s.wedged == "decode"
    s.check(now=70)
    assert s.wedged_calls == ["decode"] and s.reloaded == ["decode"]  # nothing more


def test_the_shared_memory_of_a_dead_stub_is_removed(tmp_path):
    import os

    (tmp_path / "region-a").write_bytes(b"x")
    (tmp_path / "region-b").write_bytes(b"x")
    # this test process has no stub children: every known region's stub is gone
    live = sup.remove_stale_regions(os.getpid(), {"region-a"}, shm_dir=str(tmp_path))
    assert live == set()
    assert not (tmp_path / "region-a").exists() and (tmp_path / "region-b").exists()


def test_a_stub_that_exits_wakes_the_supervisor_before_its_next_check(monkeypatch):
    """A real process stands for the stub: its pidfd ends the supervisor's wait at once,
    where the next check would have come 30 s later."""
    stub = subprocess.Popen(["sleep", "60"])
    s = Scripted(
        monkeypatch,
        instances={"decode": 1},
        interval_s=30.0,
        stubs=lambda: {stub.pid: ("decode", "")} if stub.poll() is None else {},
    )
    s.ready = {"decode"}
    s.start()
    try:
        deadline = time.monotonic() + 10
        while s.expected != Counter(decode=1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.expected == Counter(decode=1)  # the first check runs at start
        time.sleep(0.2)  # (the loop is in its 30 s wait, following the stub's pidfd)
        killed = time.monotonic()
        stub.kill()
        while not s.reloaded and time.monotonic() - killed < 10:
            time.sleep(0.01)
        assert s.reloaded == ["decode"]
        assert time.monotonic() - killed < 2.0
    finally:
        stopped = time.monotonic()
        s.stop()
        stub.kill()
        stub.wait()
    assert not s._thread.is_alive() and time.monotonic() - stopped < 2.0  # stop() wakes it too


def _beating(monkeypatch, tmp_path, frozen_after_s=30.0, states=None):
    s = Scripted(monkeypatch, stubs=lambda: {11: ("router", ""), 12: ("decode", "")})
    s.heartbeat_dir, s.frozen_after_s = tmp_path, frozen_after_s
    s.ready = {"router", "decode"}
    s.live = Counter(router=1, decode=1)
    states = {} if states is None else states  # pid -> state letter; "S" otherwise
    monkeypatch.setattr(sup, "_state", lambda pid: states.get(pid, "S"))
    return s


def _beat(tmp_path, pid, t):
    import os

    path = tmp_path / str(pid)
    path.touch()
    os.utime(path, ns=(int(t * 1e9), int(t * 1e9)))


def test_a_stub_whose_heartbeat_stands_still_restarts_the_server(monkeypatch, tmp_path):
    """A stub alive but running no Python (python_backend's BLS deadlock, or SIGSTOP): its
    heartbeat file stops changing, and frozen_after_s of watching later the server goes."""
    s = _beating(monkeypatch, tmp_path)
    for t in range(0, 31):  # both beat for 30 s, then the router's stops
        _beat(tmp_path, 11, t)
        _beat(tmp_path, 12, t)
        s.check(now=float(t))
    for t in range(31, 61):
        _beat(tmp_path, 12, t)
        s.check(now=float(t))
    assert s.wedged_calls == [] and s.wedged is None  # 30 s still: not yet over
    _beat(tmp_path, 12, 61.5)
    s.check(now=61.5)
    assert s.wedged_calls == ["router"] and s.wedged == "router"
    s.check(now=62.5)
    assert s.wedged_calls == ["router"]  # once


def test_only_time_watching_a_running_stub_counts(monkeypatch, tmp_path):
    states = {}
    s = _beating(monkeypatch, tmp_path, frozen_after_s=10.0, states=states)
    _beat(tmp_path, 11, 0)  # the router beat once; decode never did (still loading)
    for t in range(0, 5):
        s.check(now=float(t))  # 4 s watched
    s.check(now=65.0)  # this process was away a minute: counted as 3 s at most
    assert s.wedged_calls == []
    _beat(tmp_path, 11, 66)
    for t in range(66, 71):
        s.check(now=float(t))  # changed at 66: 4 s since
    states[1] = "T"  # tritonserver itself frozen (a hung node, on purpose): not counted
    for t in range(71, 81):
        s.check(now=float(t))
    states[1] = "S"
    states[11] = "t"  # a debugger holds the stub: not counted either
    for t in range(81, 91):
        s.check(now=float(t))
    del states[11]
    for t in range(91, 97):
        s.check(now=float(t))
    assert s.wedged_calls == []  # 10.0 s: not over
    s.check(now=96.5)
    assert s.wedged_calls == ["router"]


def test_a_model_being_reloaded_is_not_judged_and_a_gone_stubs_file_is_removed(
    monkeypatch, tmp_path
):
    s = _beating(monkeypatch, tmp_path, frozen_after_s=5.0)
    _beat(tmp_path, 11, 0)
    s.recovering["router"] = 1e9  # its reload under way: its stubs may be tearing down
    monkeypatch.setattr(s, "_check_recovering", lambda live, now: None)  # (held so)
    for t in range(0, 20):
        s.check(now=float(t))
    assert s.wedged_calls == []
    s.recovering.clear()
    _beat(tmp_path, 12, 0)
    s.check(now=20.0)
    assert (tmp_path / "11").exists()
    s.live = Counter(decode=1)
    monkeypatch.setattr(sup, "stub_processes", lambda pid: {12: ("decode", "")})
    s.check(now=21.0)
    assert not (tmp_path / "11").exists() and (tmp_path / "12").exists()


def test_a_frozen_limit_of_zero_judges_nothing(monkeypatch, tmp_path):
    s = _beating(monkeypatch, tmp_path, frozen_after_s=0.0)
    _beat(tmp_path, 11, 0)
    for t in range(0, 100, 10):
        s.check(now=float(t))
    assert s.wedged_calls == []


def test_a_real_heartbeat_thread_keeps_its_file_fresh(tmp_path):
    import os
    import threading

    from disagg import heartbeat

    stop = threading.Event()
    thread = heartbeat.start(tmp_path, interval_s=0.05, stop=stop)
    try:
        path = heartbeat.path_of(tmp_path, os.getpid())
        first = path.stat().st_mtime_ns
        deadline = time.monotonic() + 5
        while path.stat().st_mtime_ns == first and time.monotonic() < deadline:
            time.sleep(0.01)
        assert path.stat().st_mtime_ns != first and thread.daemon and thread.is_alive()
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not thread.is_alive()
