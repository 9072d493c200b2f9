"""engine/omp.py: a thread made serial starts no OpenMP pool of its own, and the other
threads keep torch's thread count. Counted in a fresh process (pools are per process) by
the threads the process has before and after each thread's parallel work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

_SCRIPT = r"""
import json, os, sys, threading
import torch
from disagg.engine import omp

def tasks():
    return len(os.listdir("/proc/self/task"))

out = {"serial": omp.serial_here() if sys.argv[1] == "serial" else None}
before = tasks()
x = torch.ones(1 << 22)  # far over torch's grain: its ops on x run in parallel regions
for _ in range(3):
    x.mul_(1.0)
out["main_threads"] = torch.get_num_threads()
out["main_made"] = tasks() - before

def work():
    out["worker_threads"] = torch.get_num_threads()
    before = tasks()
    for _ in range(3):
        x.add_(0.0)
    out["worker_made"] = tasks() - before

t = threading.Thread(target=work)
t.start()
t.join()
out["still_serial"] = omp.serial_here() and torch.get_num_threads() == 1
print(json.dumps(out))
"""


def _run(mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_serial_thread_makes_no_pool_and_others_keep_their_count() -> None:
    out = _run("serial")
    assert out["serial"] is True  # torch's OpenMP runtime was found and told
    assert out["main_threads"] == 1
    assert out["main_made"] == 0  # no workers: no pool for this thread
    assert out["worker_threads"] == 2  # another thread still runs torch's two threads
    assert out["worker_made"] == 1  # ... with one pool worker beside itself
    assert out["still_serial"] is True


def test_without_it_the_first_thread_makes_a_pool_too() -> None:
    """The control: the count above would see a pool where one is made."""
    out = _run("default")
    assert out["main_threads"] == 2
    assert out["main_made"] == 1
    assert out["worker_made"] == 1  # a second pool: two workers in all
