#!/usr/bin/env python3
"""bf16 block products on AMX tiles against the AVX512-BF16 lanes (engine/qbf16.c), on the
checkpoint's own blocks of layer 0 and the LM head, at decode and prompt row counts; then
whole decode steps (engine/fused_decode.py) with every product on the lanes or on the tiles.

Prompt and decode rows take the tiles where the CPU has them (kernels.linear,
fused_decode.py): these tables are why, and what it costs a single sequence. GFLOP/s counts
2 m n k; each cell is the best of three timed windows of ~0.3 s, lanes and tiles in turn;
each step time the best of three rounds of 12 steps at ~200 positions.

    python benchmarks/bf16_tiles_bench.py [--rows 1 4 8 16 64 150 512 2048]
        [--batches 1 2 4 8 16 32]

Prints two tables; writes results/bf16_tiles_bench.json and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

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
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
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
    steps = decode_steps(a.batches)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"amx": amx, "threads": torch.get_num_threads(), "rows": rows, "steps": steps}
    a.out.write_text(json.dumps(result))
    plot(rows, steps, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return 0


def forced(real: Callable[..., torch.Tensor], on: bool) -> Callable[..., torch.Tensor]:
    """quant.qlinear with `tiles` this run's choice, whatever the caller asks."""

    def qlinear(x: torch.Tensor, w: quant.QuantLinear, activations: str = "float32",
                portable: bool = False, tiles: bool = False) -> torch.Tensor:  # fmt: skip
        del tiles
        return real(x, w, activations, portable, on)

    return qlinear


def decode_steps(batches: list[int]) -> list[dict]:
    """A bf16-blocks decode step at each batch, every product on the lanes or on the tiles
    (fused_decode's qlinear calls, switched here), rounds interleaved."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from weights_bench import step_ms

    from disagg.engine.model import Llama

    model = Llama.load(ENGINE, weights="auto", activations="bfloat16")
    best: dict[tuple[bool, int], float] = {}
    for _ in range(3):
        for tiles in (False, True):
            with mock.patch.object(quant, "qlinear", forced(quant.qlinear, tiles)):
                for b in batches:
                    ms = step_ms(model, b)
                    best[(tiles, b)] = min(best.get((tiles, b), ms), ms)
    print("\n| decode batch | step on lanes (ms) | on tiles (ms) | tiles speed-up |")
    print("|---|---|---|---|")
    steps = []
    for b in batches:
        lane_ms, tile_ms = best[(False, b)], best[(True, b)]
        print(f"| {b} | {lane_ms:.2f} | {tile_ms:.2f} | {lane_ms / tile_ms:.2f}x |", flush=True)
        steps.append({"batch": b, "lanes_ms": lane_ms, "tiles_ms": tile_ms})
    return steps


def plot(rows: list[dict], steps: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
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
    bs = [s["batch"] for s in steps]
    bx.plot(bs, [s["lanes_ms"] for s in steps], marker="o", ls="--", label="lanes")
    bx.plot(bs, [s["tiles_ms"] for s in steps], marker="o", label="tiles")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("decode batch (sequences)")
    bx.set_ylabel("ms per decode step (lower is better)")
    bx.set_title("bf16 decode step, every product on lanes or tiles")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
