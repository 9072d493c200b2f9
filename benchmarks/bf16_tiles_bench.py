#!/usr/bin/env python3
"""bf16 block products on AMX tiles against the AVX512-BF16 lanes (engine/qbf16.c), on the
checkpoint's own blocks of layer 0 and the LM head, at decode and prompt row counts.

Prompt rows take the tiles where the CPU has them (kernels.linear); decode rows keep the
lanes at every batch size (fused_decode.py): this table is why. GFLOP/s counts 2 m n k;
each cell is the best of three timed windows of ~0.3 s, lanes and tiles in turn.

    python benchmarks/bf16_tiles_bench.py [--rows 1 4 8 16 64 150 512 2048]

Prints a table; writes results/bf16_tiles_bench.json and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from disagg.engine import quant

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engines" / "smollm2-135m-instruct"
SHAPES = {  # the projections kernels.linear multiplies, by their checkpoint names
    "q_proj": "model.layers.0.self_attn.q_proj.weight",
    "o_proj": "model.layers.0.self_attn.o_proj.weight",
    "gate_proj": "model.layers.0.mlp.gate_proj.weight",
    "down_proj": "model.layers.0.mlp.down_proj.weight",
    "lm_head": "model.embed_tokens.weight",
}


def gflops(x: torch.Tensor, w: quant.QuantLinear, tiles: bool) -> float:
    quant.qlinear(x, w, "bfloat16", tiles=tiles)
    t, reps = time.perf_counter(), 0
    while time.perf_counter() - t < 0.3 or reps < 2:
        quant.qlinear(x, w, "bfloat16", tiles=tiles)
        reps += 1
    return 2 * x.shape[0] * w.n * w.k * reps / (time.perf_counter() - t) / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 150, 512, 2048])
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bf16_tiles_bench.json")
    a = p.parse_args()
    if not quant.bf16_simd():
        sys.exit(f"bfloat16 block products {quant.NO_BF16}")
    blocks = quant.load_blocks(ENGINE)
    if blocks is None:
        sys.exit(f"{ENGINE} has no blocks: run `make engine`")
    amx = quant.bf16_amx()
    print(f"AMX tiles: {'yes' if amx else 'no (tiles= changes nothing here)'}", flush=True)
    rows = []
    print("| projection | fmt | n x k | rows | lanes GFLOP/s | tiles GFLOP/s | tiles / lanes |")
    print("|---|---|---|---|---|---|---|")
    for name, key in SHAPES.items():
        w = blocks[key]
        for m in a.rows:
            x = torch.randn(m, w.k, generator=torch.Generator().manual_seed(m))
            best = {False: 0.0, True: 0.0}
            for _ in range(3):
                for tiles in (False, True):
                    best[tiles] = max(best[tiles], gflops(x, w, tiles))
            rows.append({"projection": name, "fmt": w.fmt, "n": w.n, "k": w.k, "rows": m,
                         "lanes_gflops": best[False], "tiles_gflops": best[True]})  # fmt: skip
            print(f"| {name} | {w.fmt} | {w.n} x {w.k} | {m} | {best[False]:.0f} | "
                  f"{best[True]:.0f} | {best[True] / best[False]:.2f}x |", flush=True)  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"amx": amx, "threads": torch.get_num_threads(), "rows": rows}))
    plot(rows, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in SHAPES:
        got = [r for r in rows if r["projection"] == name]
        ms = [r["rows"] for r in got]
        line = ax.plot(ms, [r["tiles_gflops"] for r in got], marker="o", label=f"{name} tiles")
        ax.plot(ms, [r["lanes_gflops"] for r in got], ls="--", color=line[0].get_color())
    ax.set_xscale("log")
    ax.set_xlabel("rows (decode batch or prompt chunk)")
    ax.set_ylabel("GFLOP/s (dashed: lanes)")
    ax.set_title("bf16 block products: AMX tiles vs AVX512-BF16 lanes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
