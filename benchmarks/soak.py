#!/usr/bin/env python3
"""Soak: N concurrent streams through the gateway for a fixed time, against a real
tritonserver started here; counts what every request got and whether any stub crashed.

A stub crash shows three ways, all checked: the kernel log (segfault lines for a stub pid),
a stub pid that changed (the supervisor replaced it), and requests ending in errors. Prints
a progress line a minute and a table at the end; writes results/soak.json.

    python benchmarks/soak.py [--minutes 30] [--streams 16] [--mode disaggregated]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import openai

from disagg.serve.gateway_process import GatewayProcess
from disagg.serve.server import TritonServer, free_ports
from disagg.serve.supervisor import stub_processes
from disagg.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-soak"
PROMPTS = [
    "Tell me a story about a brave little robot.",
    "Explain why the sky is blue to a child.",
    "Write a short poem about the ocean and the moon.",
    "Describe a busy train station in the morning.",
]


def stub_pids(server_pid: int) -> dict[int, str]:
    """pid -> model of the server's live stubs."""
    return {pid: model for pid, (model, _) in stub_processes(server_pid).items()}


def segfaults() -> set[int]:
    log = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
    return {int(p) for p in re.findall(r"(?:triton_python_b|tritonserver)\[(\d+)\]: segfault", log)}


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.completed = self.errors = self.tokens = 0
        self.error_kinds: dict[str, int] = {}

    def add(self, ok: bool, tokens: int = 0, error: str = "") -> None:
        with self.lock:
            if ok:
                self.completed += 1
                self.tokens += tokens
            else:
                self.errors += 1
                self.error_kinds[error] = self.error_kinds.get(error, 0) + 1


def stream_loop(url: str, stop_at: float, tally: Tally, i: int, max_tokens: int) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    n = 0
    while time.monotonic() < stop_at:
        prompt = PROMPTS[(i + n) % len(PROMPTS)]
        n += 1
        try:
            tokens = 0
            for chunk in client.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    tokens += 1
            tally.add(True, tokens)
        except openai.APIError as e:
            tally.add(False, error=type(e).__name__)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mode", default="disaggregated")
    p.add_argument("--engine-dir", default=str(ROOT / "engines" / "smollm2-135m-instruct"))
    p.add_argument("--out", default=str(ROOT / "results" / "soak.json"))
    a = p.parse_args()

    http, grpc, metrics, gw = free_ports(4)
    build = Path(tempfile.mkdtemp(prefix="disagg-soak-"))
    settings = ServeSettings(
        engine_dir=a.engine_dir,
        build_dir=str(build),
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        gateway_port=gw,
        mode=a.mode,
        decode_max_num_seqs=a.streams,
        gateway_rpm=0,
        gateway_tpm=0,
    )
    server = TritonServer(settings)
    server.start()
    server.wait_ready(timeout_s=300)
    gateway = GatewayProcess(replace(settings), env={"DISAGG_API_KEYS": KEY}).start()
    try:
        gateway.wait_ready()
        before_pids, before_faults = stub_pids(server.proc.pid), segfaults()
        tally, start = Tally(), time.monotonic()
        stop_at = start + a.minutes * 60
        threads = [
            threading.Thread(
                target=stream_loop, args=(gateway.url, stop_at, tally, i, a.max_tokens)
            )
            for i in range(a.streams)
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(min(60.0, max(1.0, stop_at - time.monotonic())))
            minute = (time.monotonic() - start) / 60
            print(
                f"[{minute:5.1f} min] completed {tally.completed}  errors {tally.errors}  "
                f"tokens {tally.tokens}  stubs replaced "
                f"{len(set(before_pids) - set(stub_pids(server.proc.pid)))}",
                flush=True,
            )
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        after_pids = stub_pids(server.proc.pid)
        crashed = sorted(
            {before_pids[p] for p in (segfaults() - before_faults) if p in before_pids}
        )
        # faulthandler (on in every stub) reports a crash in the log; the kernel may not
        fatal = server.log_path.read_text(errors="replace").count("Fatal Python error")
        replaced = sorted(before_pids[p] for p in set(before_pids) - set(after_pids))
        server_alive = server.proc.poll() is None
    finally:
        gateway.stop()
        server.stop()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "minutes": round(elapsed / 60, 1),
        "streams": a.streams,
        "mode": a.mode,
        "completed": tally.completed,
        "errors": tally.errors,
        "error_kinds": tally.error_kinds,
        "tokens_per_s": round(tally.tokens / elapsed, 1),
        "stubs_crashed": crashed,
        "fatal_python_errors": fatal,
        "stubs_replaced": replaced,
        "tritonserver_alive": server_alive,
        "cpu": os.cpu_count(),
    }
    print()
    print(f"| soak ({a.streams} gateway streams, {a.mode}) | value |")
    print("|---|---|")
    for k in ("minutes", "completed", "errors", "tokens_per_s", "stubs_crashed",
              "fatal_python_errors", "stubs_replaced", "tritonserver_alive"):  # fmt: skip
        print(f"| {k} | {result[k]} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    ok = not crashed and not fatal and not replaced and not tally.errors and server_alive
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
