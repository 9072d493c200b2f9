"""engine/cpu_share.py: decode learns from a lock file whether a prefill process computes,
a dead prefill never holds it, and decode's steps drop to one thread and come back without
making a second OpenMP pool. Real processes and real flock locks; no model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from disagg.engine.cpu_share import PrefillActivity

pytestmark = pytest.mark.unit

_HOLDER = r"""
import sys, time
from disagg.engine.cpu_share import PrefillActivity
with PrefillActivity(sys.argv[1]).computing():
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
print("released", flush=True)
time.sleep(60)
"""


def _holder(run_dir, hold_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run_dir), str(hold_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_decode_sees_a_prefill_computing_only_while_it_does(tmp_path):
    decode = PrefillActivity(tmp_path)
    assert not decode.active()
    proc = _holder(tmp_path, 1.0)
    try:
        assert decode.active()
        assert decode.active()  # asking takes nothing from the holder
        assert proc.stdout.readline().strip() == "released"
        assert not decode.active()
    finally:
        proc.kill()
        proc.wait()
        decode.close()


def test_two_prefills_at_once_and_one_that_dies_computing(tmp_path):
    decode = PrefillActivity(tmp_path)
    first, second = _holder(tmp_path, 60), _holder(tmp_path, 60)  # shared: both hold
    try:
        assert decode.active()
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        assert decode.active()  # the other still computes
        os.kill(second.pid, signal.SIGKILL)
        second.wait()
        deadline = time.monotonic() + 5
        while decode.active() and time.monotonic() < deadline:
            time.sleep(0.01)  # the kernel drops a dead process's locks as it closes its files
        assert not decode.active()
    finally:
        for p in (first, second):
            p.kill()
            p.wait()
        decode.close()


_THREADS = r"""
import json, os, sys
import torch
from disagg.engine.cpu_share import DecodeThreads

class Activity:
    busy = False
    def active(self):
        return self.busy

def tasks():
    return len(os.listdir("/proc/self/task"))

x = torch.ones(1 << 22)
def step():
    for _ in range(3):
        x.mul_(1.0)  # parallel regions over torch's grain
    return torch.get_num_threads()

activity = Activity()
threads = DecodeThreads(activity)
out = {"full": threads.full, "seen": []}
threads.before_step(); out["seen"].append(step())
made = tasks()
for busy in (True, True, False, True, False):
    activity.busy = busy
    threads.before_step()
    out["seen"].append(step())
out["made_after_first"] = tasks() - made
out["yielded"] = threads.yielded_steps
print(json.dumps(out))
"""


def test_steps_run_on_one_thread_while_busy_and_reuse_the_same_pool():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", _THREADS], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["full"] == 2
    assert out["seen"] == [2, 1, 1, 2, 1, 2]
    assert out["yielded"] == 3
    assert out["made_after_first"] == 0  # back to two threads: the pool's worker, not a new one
