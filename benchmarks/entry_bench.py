#!/usr/bin/env python3
"""Router overhead on the local path: TTFT through `router` against `ensemble` (the same
pipeline without the router), in one run on one real tritonserver, gRPC streaming.

Rounds alternate the two models (and which goes first), so machine noise hits both alike.
Concurrency 1: one request at a time. Concurrency 16: 16 streams at once per round.
Prints a table and writes results/router_bench.json.

    python benchmarks/router_bench.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

from serving_bench import PROMPTS  # benchmarks/ is the script's own directory

from disagg.client import GrpcClient
from disagg.serve.server import TritonServer, free_ports
from disagg.serve.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("ensemble", "router")


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


def body(i: int) -> dict:
    return {
        "text_input": PROMPTS[i % len(PROMPTS)],
        "apply_chat_template": True,
        "max_tokens": 4,
        "exclude_input_in_output": True,
    }


def ttfts(clients: list[GrpcClient], model: str, offset: int) -> list[float]:
    """One request per client, all at once; their TTFTs in seconds."""
    out = [0.0] * len(clients)

    def run(i: int) -> None:
        out[i] = clients[i].generate(model, body(offset + i)).ttft_s

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def measure(clients: list[GrpcClient], rounds: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {m: [] for m in MODELS}
    for r in range(rounds):
        order = MODELS if r % 2 == 0 else MODELS[::-1]
        for model in order:
            samples[model] += ttfts(clients, model, r)
        print(f"\r  concurrency {len(clients)}: round {r + 1}/{rounds}", end="", flush=True)
    print()
    return samples


def summary(samples: dict[str, list[float]]) -> dict:
    def q(xs, p):
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e3

    row = {
        m: {"p50_ms": q(xs, 0.5), "p90_ms": q(xs, 0.9), "n": len(xs)} for m, xs in samples.items()
    }
    row["added_p50_ms"] = row["router"]["p50_ms"] - row["ensemble"]["p50_ms"]
    row["added_mean_ms"] = (
        statistics.mean(samples["router"]) - statistics.mean(samples["ensemble"])
    ) * 1e3
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", default=str(ROOT / "engines" / "smollm2-135m-instruct"))
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--rounds", type=int, default=40, help="rounds at concurrency 1 (16: /4)")
    a = p.parse_args()
    http, grpc, metrics = free_ports(3)
    settings = ServeSettings(
        engine_dir=a.engine_dir,
        build_dir=tempfile.mkdtemp(prefix="router-bench-"),
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
    )
    results = {}
    with TritonServer(settings) as server:
        clients = [GrpcClient(server.endpoints.grpc) for _ in range(16)]
        measure(clients[:1], 4)  # warm-up, discarded
        cpu0 = {m: stub_cpu_s(m) for m in ("tokenizer", "router")}
        results["concurrency_1"] = summary(measure(clients[:1], a.rounds))
        results["concurrency_16"] = summary(measure(clients, max(2, a.rounds // 4)))
        n = results["concurrency_1"]["router"]["n"] + results["concurrency_16"]["router"]["n"]
        # the ensemble's own Python step is the tokenizer; the router's is the router itself
        results["stub_cpu_ms_per_request"] = {
            m: (stub_cpu_s(m) - cpu0[m]) / n * 1e3 for m in ("tokenizer", "router")
        }
        for c in clients:
            c.close()
    print(f"\n{'':16}{'ensemble p50':>14}{'router p50':>12}{'added p50':>11}{'added mean':>12}")
    for name in ("concurrency_1", "concurrency_16"):
        row = results[name]
        print(
            f"{name:16}{row['ensemble']['p50_ms']:>11.1f} ms{row['router']['p50_ms']:>9.1f} ms"
            f"{row['added_p50_ms']:>8.1f} ms{row['added_mean_ms']:>9.1f} ms"
        )
    cpu = results["stub_cpu_ms_per_request"]
    print(
        f"CPU per request in the entry step's process: tokenizer (ensemble) "
        f"{cpu['tokenizer']:.1f} ms, router {cpu['router']:.1f} ms"
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results["command"] = "python " + " ".join(sys.argv)
    (out / "router_bench.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'router_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
