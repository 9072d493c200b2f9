#!/usr/bin/env python3
"""What prompt attention in position-fixed row blocks costs prefill (engine/layers.py).

Three ways a prompt's queries attend, per prompt length and activations, in one process,
rounds alternating them, best of each:
  one call   one torch call per layer (what a GPU does, and the CPU did before 2026-12-06)
  blocks     one torch call per block of PROMPT_ATTN_ROWS positions, so that a row's bits
             do not depend on how the prompt was split (whole, in chunks, after a cached
             prefix), as long as the splits fall on those blocks
  in C       engine/qmatmul.c, each row with a decode step's operations for its position:
             a row's bits depend on nothing else (Llama.attn_in_c, where Llama.fused)
and, as the reason for paying for either, the largest K/V difference between the prompt
prefilled cold and after its first blocks came from a cache, each way (random prompts of
each length, and a real chat prompt first: the one whose greedy reply parted in bf16).

    python benchmarks/prompt_attention_bench.py [--lengths 150 600 2000] [--rounds 4]
        [--activations bfloat16 float32]
Prints a table; writes results/prompt_attention_bench.json and .png.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from disagg.engine import quant
from disagg.engine.model import KVCacheSlots, Llama
from disagg.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
WAYS = {"one_call": (False, False), "blocks": (True, False), "c": (True, True)}  # aligned, C
QUESTION = "List three prime numbers."  # the chat template's blocks, then 3 tokens: parted


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def cached_gap(model: Llama, ids: list[int]) -> float:
    """max |K, V cold - K, V after a cached prefix| over up to 6 prefixes of whole 16-token
    blocks: the rest prefilled after the cold prompt's own first positions."""
    _, k, v = model.prefill(ids)
    n, gap = len(ids), 0.0
    cache = KVCacheSlots(model.args, max_slots=1, max_len=n)
    for cached in range(16, n, max(16, (n // 6) // 16 * 16)):
        cache.write(0, k[:, :, :cached], v[:, :, :cached])
        model.prefill_chunk(ids[cached:], cached, cache, 0)
        gap = max(gap, float((cache.k[:, 0, :, :n] - k).abs().max()))
        gap = max(gap, float((cache.v[:, 0, :, :n] - v).abs().max()))
    return gap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-dir", default=str(ROOT / "engines/smollm2-135m-instruct"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[150, 600, 2000])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--activations", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", default=str(ROOT / "results" / "prompt_attention_bench.json"))
    a = ap.parse_args()
    rows = []
    for acts in a.activations:
        if acts == "bfloat16" and not quant.bf16_simd():
            print("bfloat16: this CPU has no AVX512-BF16; skipped", flush=True)
            continue
        model = Llama.load(a.engine_dir, "auto", "cpu", "auto", acts)
        chat = Tokenizer(a.engine_dir).encode_chat([{"role": "user", "content": QUESTION}])
        for n in [len(chat), *a.lengths]:
            ids = chat if n == len(chat) else tokens(n, n)
            model.prefill(ids)  # warm
            ways = {k: w for k, w in WAYS.items() if model.fused or not w[1]}
            best = dict.fromkeys(ways, float("inf"))
            for r in range(a.rounds):
                for way, (model.aligned, model.attn_in_c) in ways.items():
                    t = time.perf_counter()
                    model.prefill(ids)
                    best[way] = min(best[way], time.perf_counter() - t)
                print(f"  {acts} {n} tokens: round {r + 1}/{a.rounds}", flush=True)
            row = {"activations": acts, "tokens": n}
            for way, (model.aligned, model.attn_in_c) in ways.items():
                row[f"{way}_s"], row[f"cached_gap_{way}"] = best[way], cached_gap(model, ids)
            rows.append(row)
    print(f"\n{'activations':<12}{'tokens':>7}{'one call s':>12}{'blocks s':>10}{'in C s':>9}"
          f"{'cached vs cold: one call':>26}{'blocks':>9}{'in C':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['activations']:<12}{r['tokens']:>7}{r['one_call_s']:>12.3f}"
              f"{r['blocks_s']:>10.3f}{r.get('c_s', float('nan')):>9.3f}"
              f"{r['cached_gap_one_call']:>26.2e}{r['cached_gap_blocks']:>9.2e}"
              f"{r.get('cached_gap_c', float('nan')):>9.2e}")  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "threads": torch.get_num_threads()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for acts in sorted({r["activations"] for r in rows}):
        mine = [r for r in rows if r["activations"] == acts]
        xs = [r["tokens"] for r in mine]
        ax.plot(xs, [r["one_call_s"] for r in mine], "o--", label=f"{acts}, one call")
        ax.plot(xs, [r["blocks_s"] for r in mine], "s-", label=f"{acts}, row blocks")
        if all("c_s" in r for r in mine):
            ax.plot(xs, [r["c_s"] for r in mine], "^-", label=f"{acts}, rows in C")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill (s, best of rounds)")
    ax.set_title("Prompt attention: one call, row blocks, rows in C")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
