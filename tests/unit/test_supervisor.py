"""The stub supervisor's decisions, from scripted process counts and model states."""

from collections import Counter

import pytest

from disagg.serve import supervisor as sup

pytestmark = pytest.mark.unit


class Scripted(sup.StubSupervisor):
    def __init__(self, monkeypatch):
        super().__init__(
            server_pid=1, http_url="http://127.0.0.1:1", admin_header="k", admin_key="v"
        )
        self._short = Counter()
        self.live: Counter = Counter()
        self.ready: set[str] = set()
        self.reloaded: list[str] = []
        monkeypatch.setattr(sup, "stub_models", lambda pid: self.live)

    def _ready_models(self):
        return self.ready

    def _reload(self, model):
        self.reloaded.append(model)


def test_a_dead_stub_of_a_ready_model_is_restarted_after_two_checks(monkeypatch):
    s = Scripted(monkeypatch)
    s.ready, s.live = {"decode", "ensemble"}, Counter(decode=2)
    s.check()
    assert s.expected == Counter(decode=2)  # ensembles have no stub and are not tracked
    s.live = Counter(decode=1)
    s.check()
    assert s.reloaded == []  # one short check may be a reload in progress
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
