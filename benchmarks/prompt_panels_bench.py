#!/usr/bin/env python3
"""Prompt rows against weight panels (engine/qbf16_panel.h) or on the per-output lane
accumulators (qbf16.c `vector`), on the AVX512-BF16 lanes: the same bits, checked here too.

Two tables, the two ways in turn, best of three each:
- the checkpoint's own blocks of layer 0 at prompt row counts, GFLOP/s (2 m n k);
- whole prefills in one process (`Llama.prefill_chunks`: one prompt of 150, 600 and 1,250
  tokens, and 16 prompts of 150 packed), seconds, and whether the logits are the same bits.

Where the CPU has AMX the engine's prompt rows take the tiles instead and neither way here
is what it serves with.

    python benchmarks/prompt_panels_bench.py [--rows 16 64 150 512 2400]

Prints both tables; writes results/prompt_panels_bench.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch

from disagg.bench.prefill_ab import prefill_ab, random_prompts
from disagg.bench.report import paired_bars
from disagg.engine import kernels, packed_prefill, quant

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engines" / "smollm2-135m-instruct"
SHAPES = {
    "q_proj": "model.layers.0.self_attn.q_proj.weight",
    "o_proj": "model.layers.0.self_attn.o_proj.weight",
    "gate_proj": "model.layers.0.mlp.gate_proj.weight",
    "down_proj": "model.layers.0.mlp.down_proj.weight",
}
WAYS = ("lanes", "panels")


def gflops(x: torch.Tensor, w: quant.QuantLinear, panels: bool) -> float:
    quant.qlinear(x, w, "bfloat16", panels=panels)
    t, reps = time.perf_counter(), 0
    while time.perf_counter() - t < 0.3 or reps < 2:
        quant.qlinear(x, w, "bfloat16", panels=panels)
        reps += 1
    return 2 * x.shape[0] * w.n * w.k * reps / (time.perf_counter() - t) / 1e9


def products(row_counts: list[int]) -> list[dict]:
    blocks = quant.load_blocks(ENGINE)
    if blocks is None:
        sys.exit(f"{ENGINE} has no blocks: run `make engine`")
    print("| projection | n x k | rows | lanes GFLOP/s | panels GFLOP/s | panels / lanes "
          "| same bits |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    out = []
    for name, key in SHAPES.items():
        w = blocks[key]
        for m in row_counts:
            x = torch.randn(m, w.k, generator=torch.Generator().manual_seed(m))
            same = torch.equal(
                quant.qlinear(x, w, "bfloat16"), quant.qlinear(x, w, "bfloat16", panels=False)
            )
            best = {way: 0.0 for way in WAYS}
            for _ in range(3):
                for way in WAYS:
                    best[way] = max(best[way], gflops(x, w, way == "panels"))
            out.append({"projection": name, "n": w.n, "k": w.k, "rows": m, "same_bits": same,
                        **{f"{way}_gflops": best[way] for way in WAYS}})  # fmt: skip
            print(f"| {name} | {w.n} x {w.k} | {m} | {best['lanes']:.0f} | {best['panels']:.0f} | "
                  f"{best['panels'] / best['lanes']:.2f}x | {same} |", flush=True)  # fmt: skip
    return out


def forced(real: Callable[..., torch.Tensor], panels: bool) -> Callable[..., torch.Tensor]:
    """quant.qlinear with `panels` this round's choice, whatever the caller asks."""

    def qlinear(*args: object, **kw: object) -> torch.Tensor:
        return real(*args, **{**kw, "panels": panels})  # type: ignore[arg-type]

    return qlinear


@contextlib.contextmanager
def forced_panels(panels: bool) -> Iterator[None]:
    fn = forced(quant.qlinear, panels)
    with (
        mock.patch.object(kernels, "qlinear", fn),
        mock.patch.object(packed_prefill, "qlinear", fn),
    ):
        yield


def prefills() -> list[dict]:
    ways = {w: functools.partial(forced_panels, w == "panels") for w in WAYS}
    return prefill_ab(ENGINE, random_prompts([150, 600, 1250]), ways, activations="bfloat16")


def plot(prods: list[dict], pre: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name in SHAPES:
        got = [r for r in prods if r["projection"] == name]
        ms = [r["rows"] for r in got]
        line = ax.plot(ms, [r["panels_gflops"] for r in got], marker="o", label=f"{name} panels")
        ax.plot(ms, [r["lanes_gflops"] for r in got], ls="--", color=line[0].get_color())
    ax.set_xscale("log")
    ax.set_xlabel("prompt rows")
    ax.set_ylabel("GFLOP/s (dashed: lane accumulators)")
    ax.set_title("bf16 block products, same bits two ways")
    ax.legend(fontsize=7)
    ways = {"lane accumulators": [r["lanes_s"] for r in pre],
            "panels": [r["panels_s"] for r in pre]}  # fmt: skip
    paired_bars(bx, [r["prompts"] for r in pre], ways, "prefill seconds (lower is better)",
                "whole prefill in one process")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 150, 512, 2400])
    p.add_argument("--out", type=Path, default=ROOT / "results" / "prompt_panels_bench.json")
    a = p.parse_args()
    if not quant.bf16_simd():
        sys.exit(f"bfloat16 block products {quant.NO_BF16}")
    if quant.bf16_amx():
        print("this CPU has AMX: the engine's prompt rows take the tiles, not these lanes")
    prods = products(a.rows)
    pre = prefills()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"threads": torch.get_num_threads(), "products": prods,
                                 "prefills": pre}))  # fmt: skip
    plot(prods, pre, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
