#!/usr/bin/env python3
"""The served pipeline (real tritonserver, HTTP clients) against the raw engine, in one run.

  - TTFT at concurrency 1: served (client-measured, generate_stream) minus in-process engine
  - throughput at concurrency 16: served streams vs the engine's own continuous batch
  - KV hand-off for 1024-token prompts: bytes and time, against that request's TTFT
Prints a table and writes results/serving_bench.json.

    python benchmarks/serving_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from disagg import contracts as C
from disagg.client import HttpClient
from disagg.engine.sequence import SamplingParams
from disagg.llm import LLM
from disagg.serve.server import TritonServer, free_ports
from disagg.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the ocean and the moon.",
    "Explain why the sky is blue to a child.",
    "List five fruits and their colours.",
    "Describe a busy train station in the morning.",
    "Give three tips for learning a new language.",
    "What do bees do in winter?",
    "Tell me a story about a brave little robot.",
]


def engine_ttft(llm: LLM, prompt: str, reps: int) -> float:
    ids = llm.encode(prompt)
    params = SamplingParams(max_tokens=1)
    llm.prefill_engine.prefill("warm", ids, params)
    times = []
    for i in range(reps):
        t = time.perf_counter()
        llm.prefill_engine.prefill(f"r{i}", ids, params)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def served_ttft(http: HttpClient, prompt: str, reps: int) -> float:
    body = {C.TEXT_INPUT: prompt, C.APPLY_CHAT_TEMPLATE: True, C.MAX_TOKENS: 4}
    http.generate("ensemble", body, stream=True)
    return statistics.median(
        http.generate("ensemble", body, stream=True).ttft_s for _ in range(reps)
    )


def engine_throughput(llm: LLM, n: int, max_tokens: int) -> tuple[float, int]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    t = time.perf_counter()
    comps = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    tokens = sum(len(c.token_ids) for c in comps)
    return tokens / (time.perf_counter() - t), tokens


def served_throughput(http: HttpClient, n: int, max_tokens: int) -> tuple[float, int]:
    results = [None] * n

    def run(i):
        results[i] = http.generate(
            "ensemble",
            {
                C.TEXT_INPUT: PROMPTS[i % len(PROMPTS)],
                C.APPLY_CHAT_TEMPLATE: True,
                C.MAX_TOKENS: max_tokens,
            },
            stream=True,
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    tokens = sum(r.num_output_tokens for r in results)
    return tokens / (time.perf_counter() - t), tokens


def handoff(http: HttpClient, n_tokens: int, reps: int) -> dict:
    rows = []
    for i in range(reps + 1):
        ids = torch.randint(100, 40000, (n_tokens,), generator=torch.Generator().manual_seed(i))
        r = http.generate("orchestrator", {C.INPUT_IDS: ids.tolist(), C.MAX_TOKENS: 2}, stream=True)
        rows.append((r.ttft_s, r.extra[C.KV_HANDOFF_US] / 1e6, r.extra[C.KV_BYTES]))
    rows = rows[1:]  # the first one warms up shared memory
    ttft = statistics.median(r[0] for r in rows)
    t = statistics.median(r[1] for r in rows)
    return {
        "prompt_tokens": n_tokens,
        "kv_MB": rows[0][2] / 1e6,
        "handoff_ms": t * 1e3,
        "ttft_ms": ttft * 1e3,
        "handoff_share_of_ttft": t / ttft,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", default=str(ROOT / "engines" / "smollm2-135m-instruct"))
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    reps, n_conc, max_tokens = (3, 8, 32) if a.quick else (10, 16, 64)
    rounds_n = 2 if a.quick else 3

    print("loading the in-process engine ...", flush=True)
    llm = LLM(a.engine_dir)
    res: dict = {"command": " ".join(sys.argv), "threads": torch.get_num_threads()}
    http_port, grpc_port, metrics_port = free_ports(3)
    settings = dataclasses.replace(  # DISAGG_<SETTING> variables apply, as for make serve
        ServeSettings.load(),
        engine_dir=a.engine_dir,
        build_dir=tempfile.mkdtemp(),
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        decode_max_num_seqs=n_conc,
    )
    res["settings"] = dataclasses.asdict(settings)
    print("starting tritonserver ...", flush=True)
    with TritonServer(settings) as server:
        http = HttpClient(server.endpoints.http)
        engine_throughput(llm, n_conc, max_tokens)  # warm-ups: buffers, shared memory, caches
        served_throughput(http, n_conc, max_tokens)
        # The machine is noisy: engine and server take turns, round after round, and each
        # round gives a ratio; the median round is reported. The server idles while the
        # in-process engine runs, and the other way round.
        rounds = []
        for r in range(rounds_n):
            print(f"round {r + 1}/{rounds_n}: TTFT, throughput ...", flush=True)
            rounds.append(
                {
                    "engine_ttft_ms": engine_ttft(llm, PROMPTS[0], reps) * 1e3,
                    "served_ttft_ms": served_ttft(http, PROMPTS[0], reps) * 1e3,
                    "engine_tok_s": engine_throughput(llm, n_conc, max_tokens)[0],
                    "served_tok_s": served_throughput(http, n_conc, max_tokens)[0],
                }
            )
        print("KV hand-off ...", flush=True)
        res["handoff"] = handoff(http, 1024, 3 if a.quick else 5)
    for rd in rounds:
        rd["ttft_overhead_ms"] = rd["served_ttft_ms"] - rd["engine_ttft_ms"]
        rd["throughput_ratio"] = rd["served_tok_s"] / rd["engine_tok_s"]
    res["rounds"] = rounds
    for key in rounds[0]:
        res[key] = statistics.median(rd[key] for rd in rounds)

    h = res["handoff"]
    print(f"""
| measure | engine (in-process) | served (tritonserver) | result |
|---|---|---|---|
| TTFT, concurrency 1 (ms, median round of {rounds_n}) | {res["engine_ttft_ms"]:.1f} | {res["served_ttft_ms"]:.1f} | +{res["ttft_overhead_ms"]:.1f} ms |
| throughput, concurrency {n_conc} (tok/s, median round) | {res["engine_tok_s"]:.1f} | {res["served_tok_s"]:.1f} | {res["throughput_ratio"] * 100:.0f}% |
| KV hand-off, {h["prompt_tokens"]}-token prompt | | {h["kv_MB"]:.1f} MB in {h["handoff_ms"]:.1f} ms | {h["handoff_share_of_ttft"] * 100:.1f}% of TTFT ({h["ttft_ms"]:.0f} ms) |
""")  # noqa: E501
    print(
        "rounds: "
        + ", ".join(
            f"+{rd['ttft_overhead_ms']:.1f} ms / {rd['throughput_ratio'] * 100:.0f}%"
            for rd in rounds
        )
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving_bench.json").write_text(json.dumps(res, indent=2))
    print(f"wrote {out / 'serving_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
