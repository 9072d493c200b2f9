"""The fault tests' rerun after upstream's tritonserver abort (tests/helpers/triton_server.py)
decides from the server's log and process, and reruns only that death, once."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.triton_server import UPSTREAM_ABORT, once_more_if_upstream_aborted

pytestmark = pytest.mark.unit


class FakeServer:
    """A TritonServer's surface the helper uses; its process is a real child that exits."""

    def __init__(self, logs: list[str]) -> None:
        self.logs = logs  # what each start's log ends with
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def log_tail(self, lines: int = 40) -> str:
        return self.logs[min(self.starts, len(self.logs) - 1)]

    def die(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(134)"])

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.wait()

    def start(self) -> None:
        self.starts += 1
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    def wait_ready(self, timeout_s: float) -> None:
        pass


def test_a_case_that_met_upstreams_abort_runs_again_on_a_restarted_server():
    server = FakeServer([f"terminate called ... '{UPSTREAM_ABORT}'", "I1203 ready"])
    runs = []

    def case():
        runs.append(server.starts)
        if not runs[1:]:
            server.die()
        return len(runs)

    with pytest.warns(UserWarning, match="upstream"):
        assert once_more_if_upstream_aborted(server, case) == 2
    assert runs == [0, 1]  # the second run was on the restarted server
    server.proc.kill()


def test_any_other_death_is_not_rerun_and_a_second_abort_fails():
    server = FakeServer(["Segmentation fault"])
    server.die()
    assert once_more_if_upstream_aborted(server, lambda: "got") == "got"  # not rerun
    twice = FakeServer([UPSTREAM_ABORT])

    def case():
        twice.die()

    with pytest.raises(AssertionError, match="twice"), pytest.warns(UserWarning):
        once_more_if_upstream_aborted(twice, case)
