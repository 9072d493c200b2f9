"""process_alive on real processes: running, stopped, a zombie, gone; die_with_parent."""

import os
import signal
import subprocess
import sys
import time

import pytest

from disagg.process import process_alive

pytestmark = pytest.mark.unit


def test_a_running_or_stopped_process_is_alive_and_a_zombie_or_a_gone_one_is_not():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_alive(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        assert process_alive(child.pid)  # stopped is not dead
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while process_alive(child.pid):  # exiting, then a zombie until reaped: dead either way
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # reported dead at once, while /proc still has it (not reaped; often still state R
        # in its exit path: the window in which a response sent to it is never read)
        assert os.path.exists(f"/proc/{child.pid}/stat")
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid)


def test_a_child_that_calls_exit_with_parent_ends_when_its_parent_is_killed():
    """The parent (a real Python process) starts a Python child that calls exit_with_parent,
    and is then SIGKILLed: no chance to clean up, yet the kernel's SIGTERM ends the child."""
    child_code = (
        "import os, time; from disagg.process import exit_with_parent; "
        "exit_with_parent(os.getppid()); print('armed', flush=True); time.sleep(60)"
    )
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {child_code!r}], stdout=subprocess.PIPE)\n"
        "assert p.stdout.readline().strip() == b'armed'\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert process_alive(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while process_alive(child):
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.05)
