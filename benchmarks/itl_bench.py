#!/usr/bin/env python3
"""Inter-token latency of running streams while long prompts arrive, in the decode engine,
per chunked-prefill budget (`prefill_chunk_tokens`): "whole" prefills each prompt at once
(a budget as large as the context), the others in chunks inside decode steps.

A few streams decode steadily; a long prompt (co-located: decode prefills it) arrives every
`--every` seconds. Per budget: the gaps between the running streams' tokens (p50, p99, max,
p99/p50) and the long prompts' time to first token. One process, the same requests per
budget, run side by side.

    python benchmarks/itl_bench.py [--prompt 1800] [--every 2] [--seconds 20]
Prints a table and writes results/itl_bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from disagg.engine.config import EngineConfig
from disagg.engine.llm_engine import DecodeEngine
from disagg.engine.sequence import SamplingParams
from disagg.llm import LLM


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(llm: LLM, budget: int, args) -> dict:
    config = EngineConfig(max_num_seqs=8, max_model_len=2048, prefill_chunk_tokens=budget)
    engine = DecodeEngine(llm.model, config, set())
    text = " ".join(f"Note {i}: the tide, the boats, the market and the rain." for i in range(200))
    long_ids = llm.encode(text)[: args.prompt]
    short = llm.encode("Tell me a long story about the sea.")
    steady = SamplingParams(max_tokens=2000 - len(short), ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"s{i}", steady, prompt_ids=short)
    last: dict[str, float] = {}
    gaps: list[float] = []
    ttft: dict[str, float] = {}
    sent: dict[str, float] = {}
    start = next_long = time.perf_counter()
    n_long = 0
    while time.perf_counter() - start < args.seconds:
        now = time.perf_counter()
        if now >= next_long and now - start > 2.0:  # the streams are running first
            rid = f"long{n_long}"
            engine.add_request(rid, SamplingParams(max_tokens=4, ignore_eos=True),
                               prompt_ids=long_ids)  # fmt: skip
            sent[rid], n_long, next_long = now, n_long + 1, now + args.every
        for o in engine.step():
            t = time.perf_counter()
            if o.token_id is None:
                continue
            if o.request_id.startswith("s"):
                if o.request_id in last and t - start > 2.0:
                    gaps.append(t - last[o.request_id])
                last[o.request_id] = t
            elif o.index == 0:
                ttft[o.request_id] = t - sent[o.request_id]
    for rid in list(engine._seqs):
        engine.finish_request(rid)
    while engine.has_unfinished:
        engine.step()
    p50, p99 = pct(gaps, 0.5), pct(gaps, 0.99)
    return {
        "budget": "whole" if budget >= 2048 else budget,
        "long_prompts": n_long,
        "itl_p50_ms": round(p50 * 1e3, 1),
        "itl_p99_ms": round(p99 * 1e3, 1),
        "itl_max_ms": round(max(gaps) * 1e3, 1),
        "p99_over_p50": round(p99 / p50, 2),
        "long_ttft_p50_ms": round(statistics.median(ttft.values()) * 1e3) if ttft else None,
        "stream_tok_s": round(len(gaps) / args.seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    p.add_argument("--budgets", default="2048,512,256,128,64")
    p.add_argument("--prompt", type=int, default=1800, help="tokens of each long prompt")
    p.add_argument("--every", type=float, default=2.0, help="seconds between long prompts")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=Path("results"))
    a = p.parse_args(argv)
    llm = LLM(a.engine_dir)
    rows = []
    for budget in (int(b) for b in a.budgets.split(",")):
        print(f"budget {budget} ...", file=sys.stderr, flush=True)
        rows.append(run(llm, budget, a))
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "itl_bench.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
