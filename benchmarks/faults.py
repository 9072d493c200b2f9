#!/usr/bin/env python3
"""Fault timings on a real tritonserver with the gateway: kill one model's stub while
requests stream through every entry point, and measure what each request got, how long
after the kill it ended, and how long until the model served again.

Prints the fault table of docs/reliability.md and writes results/faults.json.

    python benchmarks/faults.py [--models decode orchestrator prefill]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import openai

from disagg import contracts as C
from disagg.client import GenerateError, GrpcClient, HttpClient
from disagg.serve.gateway_process import GatewayProcess
from disagg.serve.server import TritonServer, free_ports
from disagg.settings import ServeSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import stub_pids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-faults"
LONG = {C.TEXT_INPUT: "Tell me a long story.", C.MAX_TOKENS: 300, C.IGNORE_EOS: True}
HUNG_S = 30  # a request still open this long after the kill counts as hung


def requests(server: TritonServer, gateway_url: str, long_prompt: bool = False):
    text = "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 120
    body = {**LONG, C.TEXT_INPUT: text} if long_prompt else LONG
    http = HttpClient(server.endpoints.http, timeout_s=120)
    oa = openai.OpenAI(base_url=gateway_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    chat = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": body[C.TEXT_INPUT]}],
        "max_tokens": 300,
        "extra_body": {"ignore_eos": True},
    }
    grpc = [GrpcClient(server.endpoints.grpc, timeout_s=120) for _ in range(2)]
    return {
        "ensemble (HTTP stream)": lambda: http.generate("ensemble", body, stream=True),
        "router (HTTP stream)": lambda: http.generate("router", body, stream=True),
        "router (gRPC stream)": lambda: grpc[0].generate("router", body),
        "ensemble (gRPC stream)": lambda: grpc[1].generate("ensemble", body),
        "gateway (SSE)": lambda: list(oa.chat.completions.create(**chat, stream=True)),
        "gateway (JSON)": lambda: oa.chat.completions.create(**chat),
    }


def one_fault(server: TritonServer, gateway_url: str, model: str, kill_after_s: float) -> dict:
    """Kill `model`'s stub `kill_after_s` after six requests started (decoding by 6 s; a
    prefill kill comes earlier, while long prompts are still in prefill)."""
    calls = requests(server, gateway_url, long_prompt=model == "prefill")
    got: dict[str, tuple[str, float]] = {}

    details: dict[str, str] = {}

    def run(name, call):
        try:
            call()
            got[name] = ("completed", time.monotonic())
        except (GenerateError, openai.APIError) as e:
            got[name] = ("clear error", time.monotonic())
            details[name] = str(e)[:200]
        except Exception as e:
            got[name] = (f"unclear: {type(e).__name__}", time.monotonic())
            details[name] = repr(e)[:200]

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for t in threads:
        t.start()
    time.sleep(kill_after_s)
    victims = [pid for pid, m in stub_pids(server.proc.pid).items() if m == model]
    os.kill(victims[0], signal.SIGKILL)
    killed = time.monotonic()
    back: list[float] = []
    probe = threading.Thread(target=_probe, args=(server, model, len(victims), killed, back))
    probe.start()
    for t in threads:  # a request still open HUNG_S after the kill counts as hung
        t.join(timeout=max(0.0, killed + HUNG_S - time.monotonic()))
    probe.join()
    ended = {n: round(t - killed, 2) for n, (_, t) in got.items()}
    kinds = [got[n][0] if n in got else "hung" for n in calls]
    hung = sorted(set(calls) - set(got))
    return {
        "model": model,
        "outcomes": {k: kinds.count(k) for k in sorted(set(kinds))},
        "hung": hung,
        "ended_after_kill_s": ended,
        "max_end_s": max(ended.values(), default=None),
        "median_end_s": statistics.median(ended.values()) if ended else None,
        "serving_again_s": round(back[0], 1) if back else None,
        "errors": details,
    }


def _probe(server: TritonServer, model: str, num_stubs: int, killed: float, back: list) -> None:
    """Seconds from the kill until a request through the router succeeds with all of the
    model's stubs up again."""
    http = HttpClient(server.endpoints.http, timeout_s=10)
    while time.monotonic() - killed < 180:
        try:
            http.generate("router", {C.TEXT_INPUT: "Hi", C.MAX_TOKENS: 2})
            if sum(m == model for m in stub_pids(server.proc.pid).values()) == num_stubs:
                back.append(time.monotonic() - killed)
                return
        except (GenerateError, OSError):
            pass
        time.sleep(0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", nargs="+", default=["decode", "orchestrator", "prefill"])
    p.add_argument("--engine-dir", default=str(ROOT / "engines" / "smollm2-135m-instruct"))
    p.add_argument("--out", default=str(ROOT / "results" / "faults.json"))
    a = p.parse_args()
    http, grpc, metrics, gw = free_ports(4)
    settings = ServeSettings(
        engine_dir=a.engine_dir,
        build_dir=tempfile.mkdtemp(prefix="disagg-faults-"),
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        gateway_port=gw,
        decode_max_num_seqs=8,
    )
    server = TritonServer(settings)
    server.start()
    server.wait_ready(timeout_s=300)
    gateway = GatewayProcess(replace(settings), env={"DISAGG_API_KEYS": KEY}).start()
    rows = []
    try:
        gateway.wait_ready()
        for model in a.models:
            print(f"killing {model}'s stub under 6 requests ...", flush=True)
            rows.append(one_fault(server, gateway.url, model, 1.0 if model == "prefill" else 6.0))
    finally:
        gateway.stop()
        server.stop()
    print(
        "\n| stub killed | requests got | ended after the kill (median / max) | hung "
        "| serving again |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        got = ", ".join(f"{n} {k}" for k, n in r["outcomes"].items())
        print(
            f"| {r['model']} | {got} | {r['median_end_s']} s / {r['max_end_s']} s "
            f"| {', '.join(r['hung']) or '-'} | {r['serving_again_s']} s |"
        )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
