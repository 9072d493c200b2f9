#!/usr/bin/env python3
"""A decode stub killed under greedy streams on one server: what the streams got (completed,
a clear error, hung; text equal to an undisturbed run) and where decode's way back goes,
read from tritonserver's log (the supervisor's reload, the stub's initialize, READY).

    python benchmarks/decode_recovery.py [--instances 1] [--rounds 3] [--streams 3]

Prints one row per kill and writes results/decode_recovery.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

from disagg import contracts as C
from disagg.client import GenerateError, HttpClient
from disagg.engine.tokenizer import Tokenizer
from disagg.serve.server import TritonServer, free_ports
from disagg.serve.supervisor import stub_processes
from disagg.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Write a long story about a dragon.", "Describe the sea at night.", "List fruits.",
           "Explain rain to a child.", "Name some rivers.", "Tell me about cats."]  # fmt: skip
HUNG_S = 120
# tritonserver's log lines that mark decode's way back (glog: I1202 03:47:22.444690 ...)
MARKS = {
    "reload": re.compile(r'"loading: decode:1"'),
    "initialize": re.compile(r"TRITONBACKEND_ModelInstanceInitialize: decode_0_0"),
    "ready": re.compile(r"successfully loaded 'decode'"),
}


def log_times(log: Path, after: float) -> dict[str, float]:
    """Wall times of the first of each mark after `after` (the log has no date: today's)."""
    today = dt.date.today()
    found: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"I\d{4} (\d\d):(\d\d):(\d\d\.\d+)", line)
        if not m:
            continue
        h, mi, sec = int(m[1]), int(m[2]), float(m[3])
        t = dt.datetime(today.year, today.month, today.day, h, mi).timestamp() + sec
        for name, pattern in MARKS.items():
            if t > after and name not in found and pattern.search(line):
                found[name] = t
    return found


def stream_all(http: HttpClient, bodies: list[dict], kill=None) -> list[tuple[str, object]]:
    """Every body streamed at once; `kill` is called at the first stream's 6th delta."""
    got: list[tuple[str, object]] = [("hung", None)] * len(bodies)

    def one(i: int) -> None:
        n = [0]

        def on_delta(_: str) -> None:
            n[0] += 1
            if kill is not None and i == 0 and n[0] == 6:
                kill()

        try:
            got[i] = ("completed", http.generate("orchestrator", bodies[i], True, on_delta))
        except GenerateError as e:
            got[i] = ("error", str(e))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HUNG_S)
    return got


def busiest_decode(server_pid: int) -> int:
    def ticks(pid: int) -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    pids = [p for p, (m, _) in stub_processes(server_pid).items() if m == "decode"]
    before = {p: ticks(p) for p in pids}
    time.sleep(0.3)
    return max(pids, key=lambda p: ticks(p) - before[p])


def one_round(server: TritonServer, http: HttpClient, bodies: list[dict]) -> dict:
    undisturbed = [r.text for _, r in stream_all(http, bodies)]  # type: ignore[union-attr]
    killed: list[float] = []

    def kill() -> None:
        os.kill(busiest_decode(server.proc.pid), signal.SIGKILL)
        killed.append(time.time())

    got = stream_all(http, bodies, kill)
    done = time.time()
    while True:  # decode serving again (a new request through the whole pipeline)
        try:
            http.generate("router", {C.TEXT_INPUT: "Hi", C.MAX_TOKENS: 1})
            break
        except GenerateError:
            time.sleep(0.2)
    time.sleep(1.5)  # the log is written a moment later
    marks = log_times(server.log_path, killed[0])
    kinds = [k for k, _ in got]
    texts = [getattr(r, "text", None) for _, r in got]
    return {
        "completed": kinds.count("completed"),
        "error": kinds.count("error"),
        "hung": kinds.count("hung"),
        "equal": sum(t == u for t, u in zip(texts, undisturbed, strict=True)),
        "errors": [str(r) for k, r in got if k == "error"],
        "streams_done_s": done - killed[0],
        **{f"{name}_s": t - killed[0] for name, t in marks.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--engine-dir", default=str(ROOT / "engines" / "smollm2-135m-instruct"))
    p.add_argument("--out", default=str(ROOT / "results" / "decode_recovery.json"))
    a = p.parse_args()
    http_port, grpc_port, metrics_port = free_ports(3)
    settings = ServeSettings(
        engine_dir=a.engine_dir, build_dir=tempfile.mkdtemp(prefix="decode-recovery-"),
        http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
        mode="disaggregated", decode_instances=a.instances, gateway_enabled=False,
    )  # fmt: skip
    tok = Tokenizer(a.engine_dir)
    bodies = [
        {C.INPUT_IDS: tok.encode(q), C.MAX_TOKENS: a.max_tokens, C.IGNORE_EOS: True,
         C.EXCLUDE_INPUT_IN_OUTPUT: True}
        for q in PROMPTS[: a.streams]
    ]  # fmt: skip
    server = TritonServer(settings, admin_key="bench-admin-key")
    server.start()
    rows = []
    try:
        server.wait_ready(timeout_s=300)
        http = HttpClient(server.endpoints.http, timeout_s=HUNG_S)
        for i in range(a.rounds):
            row = one_round(server, http, bodies)
            rows.append(row)
            print(f"round {i + 1}: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            ), flush=True)  # fmt: skip
    finally:
        server.stop()
    for key in ("reload_s", "initialize_s", "ready_s", "streams_done_s"):
        values = [r[key] for r in rows if key in r]
        if values:
            print(f"{key}: median {statistics.median(values):.2f} s, max {max(values):.2f} s")
    Path(a.out).parent.mkdir(exist_ok=True)
    Path(a.out).write_text(json.dumps({"instances": a.instances, "rounds": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
