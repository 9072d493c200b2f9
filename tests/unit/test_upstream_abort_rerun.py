"""The fault tests' rerun after upstream's tritonserver abort (tests/helpers/triton_server.py)
decides from the server's log written during the case and from how the process ended, and
reruns only that death, once."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.triton_server import (
    UPSTREAM_ABORT,
    once_more_if_upstream_aborted,
    ready_or_once_more,
)

pytestmark = pytest.mark.unit
ABORT_LINE = f"terminate called after throwing an instance of '{UPSTREAM_ABORT}'\n"


class FakeServer:
    """A TritonServer's surface the helper uses: a log file and a real child process."""

    def __init__(self, log_path, dies: list[tuple[str, int]]) -> None:
        self.log_path = log_path
        self.log_path.write_text("I1203 started\n")
        self.dies = dies  # per run of the case: (what the log gets, the exit status)
        self.runs = 0
        self.starts = 0
        self.proc = self._child("import time; time.sleep(30)")

    @staticmethod
    def _child(code: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", code])

    def run_case(self) -> int:
        """The case: the server dies as scripted for this run (or lives)."""
        line, status = self.dies[self.runs] if self.runs < len(self.dies) else ("", 0)
        self.runs += 1
        if status:
            with self.log_path.open("a") as f:
                f.write(line)
            self.stop()
            self.proc = self._child(f"raise SystemExit({status})")
        return self.runs

    def log_tail(self, lines: int = 40) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def start(self) -> None:
        self.starts += 1
        self.proc = self._child("import time; time.sleep(30)")

    def wait_ready(self, timeout_s: float) -> None:
        pass


def test_a_case_that_met_upstreams_abort_runs_again_on_a_restarted_server(tmp_path):
    server = FakeServer(tmp_path / "log", [(ABORT_LINE, 134)])
    with pytest.warns(UserWarning, match="upstream"):
        assert once_more_if_upstream_aborted(server, server.run_case) == 2
    assert server.starts == 1
    server.stop()


def test_other_deaths_and_old_lines_are_not_rerun_and_a_second_abort_fails(tmp_path):
    segfault = FakeServer(tmp_path / "a", [("Segmentation fault\n", 139)])
    assert once_more_if_upstream_aborted(segfault, segfault.run_case) == 1  # not rerun
    old = FakeServer(tmp_path / "b", [("Segmentation fault\n", 139)])
    with old.log_path.open("a") as f:
        f.write(ABORT_LINE)  # a stub's abort before the case: not this death
    assert once_more_if_upstream_aborted(old, old.run_case) == 1
    twice = FakeServer(tmp_path / "c", [(ABORT_LINE, 134), (ABORT_LINE, 134)])
    with pytest.raises(AssertionError, match="twice"), pytest.warns(UserWarning):
        once_more_if_upstream_aborted(twice, twice.run_case)


class FailingStart(FakeServer):
    """A server whose loads die as scripted, one entry per start: wait_ready raises as
    TritonServer's does when the process exited."""

    def wait_ready(self, timeout_s: float) -> None:
        dies = self.runs < len(self.dies) and self.dies[self.runs][1] != 0
        self.run_case()
        if dies:
            raise RuntimeError("tritonserver exited")


def test_a_start_that_met_upstreams_abort_starts_once_more_and_nothing_else_does(tmp_path):
    aborted = FailingStart(tmp_path / "a", [(ABORT_LINE, 134), ("", 0)])
    with pytest.warns(UserWarning, match="while starting"):
        ready_or_once_more(aborted)
    assert (aborted.starts, aborted.runs) == (1, 2)
    aborted.stop()
    segfault = FailingStart(tmp_path / "b", [("Segmentation fault\n", 139)])
    with pytest.raises(RuntimeError, match="exited"):
        ready_or_once_more(segfault)
    assert segfault.starts == 0
    twice = FailingStart(tmp_path / "c", [(ABORT_LINE, 134), (ABORT_LINE, 134)])
    with pytest.raises(RuntimeError, match="exited"), pytest.warns(UserWarning):
        ready_or_once_more(twice)
    assert twice.starts == 1
