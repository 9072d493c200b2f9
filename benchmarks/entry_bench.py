#!/usr/bin/env python3
"""What each entry point adds to TTFT, in one run on one real tritonserver:

  ensemble   gRPC streaming, tokenizer -> orchestrator (the pipeline alone)
  router     gRPC streaming, the router in front of it (issue 4: router overhead)
  gateway    the official `openai` client, SSE, through the OpenAI gateway to the router
             (issue 5: gateway overhead, against calling the router directly)

Rounds rotate the entry points (and which goes first), so machine noise hits all alike.
Concurrency 1: one request at a time. Concurrency 16: 16 streams at once per round.
Prints a table and writes results/entry_bench.json.

    python benchmarks/entry_bench.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
from serving_bench import PROMPTS  # benchmarks/ is the script's own directory

from disagg import contracts as C
from disagg.client import GrpcClient
from disagg.serve.gateway_process import GatewayProcess
from disagg.serve.server import TritonServer, free_ports
from disagg.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("ensemble", "router", "gateway")


def stub_cpu_s(model: str) -> float:
    """CPU seconds used so far by the Python stub process(es) of one model."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            if b"triton_python_backend_stub" in cmd and f"/{model}/1/".encode() in cmd:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            continue
    return total


MAX_TOKENS = 4
API_KEY = "sk-entry-bench"


def body(i: int) -> dict:
    return {
        C.TEXT_INPUT: PROMPTS[i % len(PROMPTS)],
        C.APPLY_CHAT_TEMPLATE: True,
        C.MAX_TOKENS: MAX_TOKENS,
        C.EXCLUDE_INPUT_IN_OUTPUT: True,
    }


class Client:
    """One user: a gRPC client (ensemble, router) and an OpenAI client (gateway)."""

    def __init__(self, grpc_url: str, gateway_url: str) -> None:
        self.grpc = GrpcClient(grpc_url)
        self.openai = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0)

    def ttft(self, path: str, i: int) -> float:
        if path != "gateway":
            return self.grpc.generate(path, body(i)).ttft_s
        start = time.perf_counter()
        stream = self.openai.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        first = 0.0
        for chunk in stream:
            if not first and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
        return first

    def close(self) -> None:
        self.grpc.close()
        self.openai.close()


def ttfts(clients: list[Client], path: str, offset: int) -> list[float]:
    """One request per client, all at once; their TTFTs in seconds."""
    out = [0.0] * len(clients)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = clients[i].ttft(path, offset + i)
        except BaseException as e:  # a failed request must fail the benchmark, not read as 0
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} {path} request(s) failed: {errors[0]!r}")
    return out


def measure(clients: list[Client], rounds: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {p: [] for p in PATHS}
    for r in range(rounds):
        k = r % len(PATHS)
        order = PATHS[k:] + PATHS[:k]  # rotate which goes first
        for path in order:
            samples[path] += ttfts(clients, path, r)
        print(f"\r  concurrency {len(clients)}: round {r + 1}/{rounds}", end="", flush=True)
    print()
    return samples


def summary(samples: dict[str, list[float]]) -> dict:
    def q(xs, p):
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e3

    row: dict = {
        p: {"p50_ms": q(xs, 0.5), "p90_ms": q(xs, 0.9), "mean_ms": statistics.mean(xs) * 1e3}
        for p, xs in samples.items()
    }
    for name, (a, b) in {
        "router_vs_ensemble": ("router", "ensemble"),
        "gateway_vs_router": ("gateway", "router"),
    }.items():
        row[name] = {
            "added_p50_ms": row[a]["p50_ms"] - row[b]["p50_ms"],
            "added_mean_ms": row[a]["mean_ms"] - row[b]["mean_ms"],
        }
    row["n"] = len(samples["router"])
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", default=str(ROOT / "engines" / "smollm2-135m-instruct"))
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--rounds", type=int, default=60, help="rounds at concurrency 1 (16: /4)")
    a = p.parse_args()
    http, grpc, metrics, gw = free_ports(4)
    settings = ServeSettings(
        engine_dir=a.engine_dir,
        build_dir=tempfile.mkdtemp(prefix="entry-bench-"),
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        gateway_port=gw,
    )
    results: dict = {}
    with TritonServer(settings) as server:
        gateway = GatewayProcess(settings, env={"DISAGG_API_KEYS": API_KEY}).start()
        try:
            gateway.wait_ready()
            clients = [Client(server.endpoints.grpc, gateway.url) for _ in range(16)]
            measure(clients[:1], 3)  # warm-up, discarded
            cpu0 = {m: stub_cpu_s(m) for m in ("tokenizer", "router")}
            results["concurrency_1"] = summary(measure(clients[:1], a.rounds))
            results["concurrency_16"] = summary(measure(clients, max(2, a.rounds // 4)))
            n = results["concurrency_1"]["n"] + results["concurrency_16"]["n"] * 2  # router+gw
            n_ens = results["concurrency_1"]["n"] + results["concurrency_16"]["n"]
            # the ensemble's own Python step is the tokenizer; the router's is itself
            results["stub_cpu_ms_per_request"] = {
                "tokenizer": (stub_cpu_s("tokenizer") - cpu0["tokenizer"]) / n_ens * 1e3,
                "router": (stub_cpu_s("router") - cpu0["router"]) / n * 1e3,
            }
            for c in clients:
                c.close()
        finally:
            gateway.stop()
    results["command"] = "python " + " ".join(sys.argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "entry_bench.json").write_text(json.dumps(results, indent=2))
    print(
        f"\n{'TTFT p50 / mean (ms)':24}{'ensemble':>16}{'router':>16}{'gateway':>16}"
        f"{'router added':>16}{'gateway added':>16}"
    )
    for name in ("concurrency_1", "concurrency_16"):
        row = results[name]
        cells = [f"{row[p]['p50_ms']:.1f} / {row[p]['mean_ms']:.1f}" for p in PATHS]
        added = [
            f"{row[k]['added_p50_ms']:+.1f} / {row[k]['added_mean_ms']:+.1f}"
            for k in ("router_vs_ensemble", "gateway_vs_router")
        ]
        print(f"{name:24}" + "".join(f"{c:>16}" for c in cells + added))
    cpu = results["stub_cpu_ms_per_request"]
    print(
        f"CPU per request in the entry step's process: tokenizer (ensemble) "
        f"{cpu['tokenizer']:.1f} ms, router {cpu['router']:.1f} ms"
    )
    print(f"wrote {out / 'entry_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
