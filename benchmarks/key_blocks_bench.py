#!/usr/bin/env python3
"""Prompt attention (engine/qmatmul.c) with the keys in blocks and the rows two by two
(engine/prompt_keys.h, AVX-512), or the keys read position by position and the rows one by
one, as decode reads its cache: the same bits, checked here too.

Two tables, the two ways in turn, best of three each:
- the kernel alone (SmolLM2's 9 heads, 3 kv heads, head_dim 64) on a whole causal prompt,
  milliseconds a layer, beside torch's scaled_dot_product_attention (fp32, causal): the
  kernel a plain PyTorch stack calls, which gives other bits when a prompt is cut in chunks;
- whole prefills in one process (`Llama.prefill_chunks`, as served: the checkpoint's blocks,
  bf16 activations where the CPU has them), seconds, and whether the logits are the same bits.

    python benchmarks/key_blocks_bench.py [--lengths 150 500 1250 2000]

Prints both tables; writes results/key_blocks_bench.json and .png.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from disagg.bench.prefill_ab import prefill_ab, random_prompts
from disagg.bench.report import paired_bars
from disagg.engine import layers, quant

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engines" / "smollm2-135m-instruct"
HEADS, KV_HEADS, D = 9, 3, 64
WAYS = ("positions", "blocks")


def best_ms(fn: Callable[[], object]) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def kernel(lengths: list[int]) -> list[dict]:
    print("| prompt tokens | by position (ms) | key blocks (ms) | speed-up | torch SDPA (ms) "
          "| same bits |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    rows = []
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        q = torch.randn(n, HEADS, D, generator=g)
        k, v = (torch.randn(KV_HEADS, n, D, generator=g) for _ in range(2))
        same = torch.equal(*(layers.attention_in_c(q, k, v, 0, 0.125, w == "blocks") for w in WAYS))
        best = {w: float("inf") for w in WAYS}
        for _ in range(3):
            for w in WAYS:
                fn = functools.partial(layers.attention_in_c, q, k, v, 0, 0.125, w == "blocks")
                best[w] = min(best[w], best_ms(fn))
        qh = q.transpose(0, 1)[None]
        sdpa = best_ms(functools.partial(
            F.scaled_dot_product_attention, qh, k[None], v[None], is_causal=True,
            enable_gqa=True, scale=0.125))  # fmt: skip
        speedup = best["positions"] / best["blocks"]
        print(f"| {n} | {best['positions']:.2f} | {best['blocks']:.2f} | {speedup:.2f}x "
              f"| {sdpa:.2f} | {same} |", flush=True)  # fmt: skip
        rows.append({"tokens": n, "positions_ms": best["positions"], "blocks_ms": best["blocks"],
                     "sdpa_ms": sdpa, "same_bits": same})  # fmt: skip
    return rows


def prefills(lengths: list[int]) -> list[dict]:
    def way(blocks: bool) -> Callable[[], AbstractContextManager[object]]:
        fn = functools.partial(layers.attention_in_c, key_blocks=blocks)
        return lambda: mock.patch.object(layers, "attention_in_c", fn)

    return prefill_ab(ENGINE, random_prompts(lengths), {w: way(w == "blocks") for w in WAYS})


def plot(ker: list[dict], pre: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ns = [r["tokens"] for r in ker]
    for key, label in (("positions_ms", "keys by position"), ("blocks_ms", "key blocks"),
                       ("sdpa_ms", "torch SDPA (other bits in chunks)")):  # fmt: skip
        ax.plot(ns, [r[key] for r in ker], marker="o", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms a layer (lower is better)")
    ax.set_title("causal prompt attention, 9 heads / 3 kv heads")
    ax.legend(fontsize=8)
    ways = {"keys by position": [r["positions_s"] for r in pre],
            "key blocks": [r["blocks_s"] for r in pre]}  # fmt: skip
    paired_bars(bx, [r["prompts"] for r in pre], ways, "prefill seconds (lower is better)",
                "whole prefill in one process")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[150, 500, 1250, 2000])
    p.add_argument("--out", type=Path, default=ROOT / "results" / "key_blocks_bench.json")
    a = p.parse_args()
    if quant.available() is not None:
        sys.exit(f"the C kernels: {quant.available()}")
    ker = kernel(a.lengths)
    pre = prefills([n for n in a.lengths if n >= 500] or a.lengths)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"threads": torch.get_num_threads(), "kernel": ker,
                                 "prefills": pre}))  # fmt: skip
    plot(ker, pre, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
