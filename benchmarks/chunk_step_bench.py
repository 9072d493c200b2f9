#!/usr/bin/env python3
"""The chunk-plus-decode step against its parts (issue 24, step 3), in the decode engine.

A step that advances a prompt by one chunk beside B decoding sequences runs the chunk's
forward and the batch's decode forward one after the other. The issue's target: such a
step no slower than a decode step plus the chunk's own compute. Per batch size B and chunk
budget, one process, side by side:
  decode   the median engine step with B sequences decoding and nothing prefilling
  chunk    the chunks of one long prompt prefilled alone (`Llama.prefill_chunks`), at the
           positions the engine gives them, summed
  step     the engine steps that prefilled that prompt in chunks while B sequences decoded,
           summed
and the ratio step / (chunks x decode + chunk), which the target holds at <= 1. Then one
layer's products (x30) on the block kernel and on the dense copy by row count: what a fused
step, decode's rows and a chunk's in one pass over one of them, would cost instead.

    python benchmarks/chunk_step_bench.py [--batches 1 4 16] [--chunks 64 256]
Prints a table; writes results/chunk_step_bench.json and results/chunk_step_bench.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from disagg.engine.config import EngineConfig
from disagg.engine.llm_engine import DecodeEngine
from disagg.engine.model import KVCacheSlots, Llama
from disagg.engine.packed_prefill import Chunk
from disagg.engine.sequence import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import median_time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def engine_with(model: Llama, batch: int, chunk: int) -> DecodeEngine:
    """B sequences decoding (200-token prompts, all prefilled before the clock starts)."""
    cfg = EngineConfig(
        max_num_seqs=batch + 1, max_model_len=2048, prefill_chunk_tokens=chunk,
        prefix_cache_tokens=0, prefault_kv=True,
    )  # fmt: skip
    engine = DecodeEngine(model, cfg, eos_token_ids=set())
    engine.cache.prefaulted.wait()
    for i in range(batch):
        params = SamplingParams(max_tokens=1000, ignore_eos=True)
        engine.add_request(f"d{i}", params, prompt_ids=tokens(200, i))
    while any(s.prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # (prompts past the first burst step go in chunks)
    engine.step()
    return engine


def measure(model: Llama, batch: int, chunk: int, prompt_len: int, steps: int) -> dict:
    engine = engine_with(model, batch, chunk)
    decode = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - t)
    prompt = tokens(prompt_len, 999)
    engine.add_request("p", SamplingParams(max_tokens=2, ignore_eos=True), prompt_ids=prompt)
    seq = engine._seqs["p"]  # (read only: which steps prefilled a chunk of it)
    with_chunk, n = 0.0, 0
    while seq.prefilling or seq.prefill_pos is None and not seq.output_ids:
        t = time.perf_counter()
        engine.step()
        with_chunk += time.perf_counter() - t
        n += 1
    # the same chunks alone, at the same positions, in a cache of their own
    cache = KVCacheSlots(model.args, 1, 2048, prefault=True)
    cache.prefaulted.wait()
    alone = 0.0
    for start in range(0, prompt_len, chunk):
        c = Chunk(prompt[start : start + chunk], start, 0)
        t = time.perf_counter()
        model.prefill_chunks([c], cache)
        alone += time.perf_counter() - t
    step = statistics.median(decode)
    return {
        "batch": batch, "chunk": chunk, "prompt": prompt_len, "chunk_steps": n,
        "decode_ms": step * 1e3, "chunks_alone_s": alone, "steps_s": with_chunk,
        "ratio": with_chunk / (n * step + alone),
    }  # fmt: skip


def kernels(model: Llama, row_counts: list[int], reps: int = 10) -> list[dict]:
    """One layer's four products over the block kernel and over the dense copy, x30: what a
    forward of that many rows costs each way (a fused step would put decode's rows and a
    chunk's through one of them)."""
    from disagg.engine.kernels import BlockLinear, linear
    from disagg.engine.quant import qlinear

    lins = [v for v in vars(model.layers[0]).values() if isinstance(v, BlockLinear)]

    out = []
    for n in row_counts:
        xs = [torch.randn(n, lin.blocks.k) for lin in lins]
        pairs = list(zip(xs, lins, strict=True))
        blocks = sum(median_time(partial(qlinear, x, lin.blocks), reps) for x, lin in pairs)
        dense = sum(median_time(partial(linear, x, lin.dense), reps) for x, lin in pairs)
        out.append({"rows": n, "blocks_ms": 30 * blocks * 1e3, "dense_ms": 30 * dense * 1e3})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"B={r['batch']}\nchunk {r['chunk']}" for r in rows]
    x = range(len(rows))
    parts = [r["chunk_steps"] * r["decode_ms"] / 1e3 + r["chunks_alone_s"] for r in rows]
    ax.bar([i - 0.2 for i in x], parts, 0.4, label="decode steps + chunks alone")
    ax.bar([i + 0.2 for i in x], [r["steps_s"] for r in rows], 0.4, label="chunk+decode steps")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("seconds to prefill the prompt")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompt", type=int, default=1024, help="tokens of the chunked prompt")
    p.add_argument("--steps", type=int, default=15, help="decode-only steps timed")
    p.add_argument("--out", default=str(ROOT / "results" / "chunk_step_bench.json"))
    a = p.parse_args()
    model = Llama.load(a.engine_dir, "auto")
    measure(model, 1, 64, 128, 3)  # warm-up: kernels, caches
    rows = []
    head = "| B | chunk | chunk steps | decode step (ms) | chunks alone (s) | chunk+decode (s)"
    print(head + " | ratio |\n|---|---|---|---|---|---|---|", flush=True)
    for b in a.batches:
        for c in a.chunks:
            r = measure(model, b, c, a.prompt, a.steps)
            rows.append(r)
            print(f"| {b} | {c} | {r['chunk_steps']} | {r['decode_ms']:.1f} | "
                  f"{r['chunks_alone_s']:.2f} | {r['steps_s']:.2f} | {r['ratio']:.2f} |",
                  flush=True)  # fmt: skip
    print("\n| rows | 30 layers' products on blocks (ms) | on the dense copy (ms) |\n|---|---|---|")
    kern = kernels(model, [1, 16, 17, 32, 64, 80, 128, 256])
    for k in kern:
        print(f"| {k['rows']} | {k['blocks_ms']:.1f} | {k['dense_ms']:.1f} |", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "kernels": kern, "args": vars(a)}, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
