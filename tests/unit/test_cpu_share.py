"""engine/cpu_share.py: each side learns from a lock file whether the other computes, a dead
process never holds one, decode's steps drop to one thread and come back without making a
second OpenMP pool, and a prefill takes every core only while decode idles. Real processes
and real flock locks; no model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from disagg.engine.cpu_share import (
    DECODE_STEPPING,
    PREFILL_COMPUTING,
    Activity,
    DecodeThreads,
    PrefillThreads,
)

pytestmark = pytest.mark.unit

_HOLDER = r"""
import sys, time
from disagg.engine.cpu_share import Activity
with Activity(sys.argv[1], sys.argv[2]).computing():
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
print("released", flush=True)
time.sleep(60)
"""


def _holder(run_dir, name: str, hold_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run_dir), name, str(hold_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_one_side_sees_the_other_computing_only_while_it_does(tmp_path):
    decode = Activity(tmp_path, PREFILL_COMPUTING)
    assert not decode.active()
    proc = _holder(tmp_path, PREFILL_COMPUTING, 1.0)
    try:
        assert decode.active()
        assert decode.active()  # asking takes nothing from the holder
        assert not Activity(tmp_path, DECODE_STEPPING).active()  # the other lock is apart
        assert proc.stdout.readline().strip() == "released"
        assert not decode.active()
    finally:
        proc.kill()
        proc.wait()
        decode.close()


def test_two_holders_at_once_and_one_that_dies_holding(tmp_path):
    decode = Activity(tmp_path, PREFILL_COMPUTING)
    first = _holder(tmp_path, PREFILL_COMPUTING, 60)
    second = _holder(tmp_path, PREFILL_COMPUTING, 60)  # shared: both hold
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


_SIDES = r"""
import json, os, sys
import torch
from disagg.engine.cpu_share import DecodeThreads

def tasks():
    return len(os.listdir("/proc/self/task"))

x = torch.ones(1 << 22)
def step():
    for _ in range(3):
        x.mul_(1.0)  # parallel regions over torch's grain
    return torch.get_num_threads()

run_dir = sys.argv[1]
decode = DecodeThreads(run_dir)
out = {"full": decode.full, "seen": []}
decode.before_step(); out["seen"].append(step())
made = tasks()
for line in sys.stdin:  # "busy" / "free": a prefill computes in the parent, or not
    decode.before_step()
    out["seen"].append(step())
    if line.strip() == "idle":
        decode.idle()
    print("stepped", flush=True)
out["made_after_first"] = tasks() - made
out["shared_steps"] = decode.shared_steps
print(json.dumps(out), flush=True)
"""


def test_decode_yields_while_a_prefill_computes_and_a_prefill_takes_all_while_decode_idles(
    tmp_path,
):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIDES, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    prefill = PrefillThreads(tmp_path, full=2, shared=1)  # sets this process's count: restored
    chosen, before = [], torch.get_num_threads()
    try:
        stepping = Activity(tmp_path, DECODE_STEPPING)

        def decode_step(then: str = "") -> None:
            proc.stdin.write(then + "\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "stepped"

        decode_step()  # stepping: the decode process holds its lock
        assert stepping.active()
        with prefill.computing() as threads:
            chosen.append(threads)
            decode_step()
            decode_step()
        decode_step("idle")  # a step, then nothing left: decode lets go
        assert not stepping.active()
        with prefill.computing() as threads:  # decode idles: every core
            chosen.append(threads)
            decode_step()  # a step begins: decode is stepping again, on one thread
            stop = prefill.between_layers(lambda: False)  # the prefill's next layer
            assert stop() is False
            chosen.append(torch.get_num_threads())  # down to one: decode steps
        proc.stdin.close()
        out = json.loads(proc.stdout.read().strip().splitlines()[-1])
    finally:
        proc.kill()
        proc.wait()
        prefill.close()
        torch.set_num_threads(before)
    assert chosen == [1, 2, 1]
    assert out["full"] == 2
    assert out["seen"] == [2, 2, 1, 1, 2, 1]
    assert out["shared_steps"] == 3
    assert out["made_after_first"] == 0  # back to two threads: the pool's worker, not a new one


def test_a_decode_that_does_not_yield_still_tells_the_prefill_it_steps(tmp_path):
    """Two decode instances (two pools each): the count stays, the stepping lock is held,
    so a prefill beside them keeps to its shared count."""
    before = torch.get_num_threads()
    decode = DecodeThreads(tmp_path, yields=False)
    prefill = PrefillThreads(tmp_path, full=2, shared=1)
    holder = _holder(tmp_path, PREFILL_COMPUTING, 60)  # another prefill computes
    try:
        decode.before_step()
        assert torch.get_num_threads() == before and decode.shared_steps == 0
        assert prefill.adjust() == 1  # decode steps: the prefill keeps to one thread
        decode.idle()
        assert prefill.adjust() == 2
    finally:
        holder.kill()
        holder.wait()
        decode.close()
        prefill.close()
        torch.set_num_threads(before)
