"""The live planner acting on real servers (issue 26 item 5): `disagg cluster --autoscale`
starts with one prefill and one decode server, each on one core's worth of threads. A step
from light to heavy prefill load adds a prefill server (decided within 30 s, listed once
ready) and the latency of the same load falls; when the load falls, the server is drained
and stopped; no request fails or hangs in any phase, and no pool acts faster than the
cooldown. Every request is counted: completed, clear error, hung."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
from helpers.processes import OutputLines
from helpers.triton_server import free_port_base, free_ports, serve_env

from disagg import contracts as C
from disagg import status as S
from disagg.client import GenerateError, HttpClient

pytestmark = pytest.mark.integration
COOLDOWN_S = 20.0
CLIENTS = 4  # closed loop: one server's queue holds ~3 prompts, two servers' ~1 each
HUNG_S = 90.0


@dataclass
class Load:
    """Closed-loop clients of the frontend's orchestrator; each request's (start, seconds,
    outcome) kept."""

    url: str
    results: list[tuple[float, float, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, clients: int, prompt_tokens: int, pause_s: float = 0.0) -> None:
        self.stop = threading.Event()
        stop = self.stop
        for i in range(clients):
            t = threading.Thread(target=self._loop, args=(stop, prompt_tokens, pause_s, i))
            t.start()
            self.threads.append(t)

    def _loop(self, stop: threading.Event, tokens: int, pause_s: float, seed: int) -> None:
        rng = random.Random(seed * 7919 + int(time.monotonic() * 1000))
        client = HttpClient(self.url, timeout_s=HUNG_S)
        while not stop.is_set():
            ids = [rng.randrange(1000, 40000) for _ in range(tokens)]  # no prefix shared
            t = time.monotonic()
            try:
                client.generate("orchestrator", {C.INPUT_IDS: ids, C.MAX_TOKENS: 2})
                outcome = "completed"
            except GenerateError as e:
                outcome = f"error: {e}"
            except OSError as e:  # a timeout: the request hung
                outcome = f"hung: {e}"
            self.results.append((t, time.monotonic() - t, outcome))
            stop.wait(pause_s)

    def halt(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(HUNG_S + 10)
        self.threads = []

    def latency(self, since: float, until: float) -> list[float]:
        return sorted(s for t, s, o in self.results if since <= t < until and o == "completed")


def _median(xs: list[float]) -> float:
    return xs[len(xs) // 2]


def test_the_planner_adds_a_prefill_server_under_load_and_drains_it_after(tmp_path, engine_dir):
    base = free_port_base(47400, 130)
    (planner_port,) = free_ports(1)
    log = tmp_path / "decisions.jsonl"
    env, ports = serve_env(
        engine_dir, tmp_path, prefill_torch_threads=1, decode_torch_threads=1,
        prefix_cache_tokens=0,
    )  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "disagg", "cluster", "--prefill", "1", "--decode", "1",
         "--base-port", str(base), "--autoscale", "--max-prefill", "2", "--max-decode", "1",
         "--queue-ms", "500", "--up-for-s", "4", "--down-for-s", "8",
         "--cooldown-s", str(COOLDOWN_S), "--planner-interval-s", "1",
         "--planner-port", str(planner_port), "--planner-log", str(log)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    out = OutputLines(proc)
    load = Load(f"http://127.0.0.1:{ports['http']}")
    try:
        out.wait("live planner:", 300)
        load.start(1, 16, pause_s=0.5)  # light
        time.sleep(6)
        load.halt()
        heavy = time.monotonic()
        load.start(CLIENTS, 400)  # prompts arrive faster than one prefill core computes them
        listed, _ = out.wait("prefill-1 listed", 30 + 120)  # decided in 30 s, then its start
        decided = _decisions(log)[0]
        assert (decided["pool"], decided["action"], decided["replicas"]) == ("prefill", "up", 2)
        assert decided["reason"] in ("queue", "ttft"), decided
        assert decided["at"] - heavy < 30, decided
        time.sleep(30)
        load.halt()
        before = load.latency(heavy, listed)  # every one of these went to the one server
        after = load.latency(listed + 5, listed + 30)
        assert len(before) >= 4 and len(after) >= 4, (before, after)
        print(f"\nheavy load -> decision {decided['at'] - heavy:.1f} s, -> listed "
              f"{listed - heavy:.1f} s; {CLIENTS} clients' latency p50 {_median(before):.2f} s "
              f"({len(before)} requests) -> {_median(after):.2f} s ({len(after)})")  # fmt: skip
        # the same closed-loop load: the second server's core takes half the prompts
        assert _median(after) < 0.8 * _median(before), (before, after)
        served = _scrape(f"http://127.0.0.1:{ports['metrics']}/metrics")
        new_addr = f"127.0.0.1:{base + 11}"
        assert S.total(served, "disagg_replica_requests_total", replica=new_addr) > 0
        load.start(1, 16, pause_s=0.3)  # light again: the second server drains
        light = time.monotonic()
        drained, _ = out.wait("prefill-1 drained and stopped", 8 + COOLDOWN_S + 60)
        print(f"light load -> drained and stopped {drained - light:.1f} s")
        time.sleep(3)
        load.halt()
        outcomes = [o for _, _, o in load.results]
        assert outcomes and all(o == "completed" for o in outcomes), [
            o for o in outcomes if o != "completed"
        ][:5]
        decisions = _decisions(log)
        assert [(d["pool"], d["action"]) for d in decisions] == [
            ("prefill", "up"),
            ("prefill", "down"),
        ], decisions
        assert decisions[1]["at"] - decisions[0]["at"] >= COOLDOWN_S
        metrics = _scrape(f"http://127.0.0.1:{planner_port}/metrics")
        assert S.total(metrics, "disagg_planner_decisions_total", pool="prefill") == 2
        assert S.total(metrics, "disagg_planner_replicas", pool="prefill") == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, out.text()[-3000:]
    finally:
        load.halt()
        if proc.poll() is None:  # SIGINT first: the cluster stops its servers itself
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _decisions(path) -> list[dict]:
    """The planner's JSON lines, each with `at`: its time on this process's monotonic clock."""
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    offset = time.time() - time.monotonic()
    return [{**d, "at": d["time"] - offset} for d in lines]


def _scrape(url: str) -> list[S.Sample]:
    return S.scrape(url)
