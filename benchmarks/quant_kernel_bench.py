#!/usr/bin/env python3
"""Weight-only quantized CPU kernels against the engine's fp32 linear (issue 24, step 1:
"measure them against alternatives before choosing"), on SmolLM2-135M's layer shapes.

For each shape, at 1 and 16 rows (batch-1 decode and a full batch): torch's
`_weight_int4pack_mm_for_cpu` (groups of 32 with a scale and a zero: the GGUF's Q4_1 maps to
it exactly) and `_weight_int8pack_mm` (per-output-channel scale), each with bf16 activations
(their fast path; fp32 activations fall back to a slow one) and with fp32; against
`kernels.linear` (oneDNN fp32, what the engine runs). Also whether each kernel gives a row
the same result alone as beside 15 others (batch invariance, which the engine's greedy
equality tests rely on). Layer totals count the 30 decoder layers; the LM head is apart.

    python benchmarks/quant_kernel_bench.py [--repeat 100]

Prints a table; writes results/quant_kernel_bench.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from disagg.engine.kernels import linear, pack

ROOT = Path(__file__).resolve().parents[1]
GROUP = 32
LAYER = {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536)}
HEAD = (49152, 576)


def timed(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(5):
        fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1e6  # us


def kernels(n: int, k: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(n * k)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    d = torch.rand(n, k // GROUP, generator=g) * 0.01
    m = -torch.rand(n, k // GROUP, generator=g) * 0.05
    w = (q.view(n, -1, GROUP).float() * d[..., None] + m[..., None]).view(n, k)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    zeros = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).contiguous()  # [K/32, N, 2]
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(n, generator=g) * 0.01
    dense = pack(w)
    return {
        "fp32 oneDNN": lambda x: linear(x.float(), dense),
        "int4 bf16-act": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), int4, GROUP, zeros.bfloat16()
        ),
        "int8 bf16-act": lambda x: torch.ops.aten._weight_int8pack_mm(
            x.bfloat16(), w8, s8.bfloat16()
        ),
        "int8 fp32-act": lambda x: torch.ops.aten._weight_int8pack_mm(x.float(), w8, s8),
    }


def measure(repeat: int) -> dict:
    out: dict = {"shapes": {}, "layer_us": {}, "invariant": {}}
    for name, (n, k) in {**LAYER, "lm_head": HEAD}.items():
        row: dict = {}
        for kname, fn in kernels(n, k).items():
            x16 = torch.randn(16, k)
            row[kname] = {
                rows: timed(lambda x=x16[:rows], f=fn: f(x), repeat if n < 10000 else repeat // 10)
                for rows in (1, 16)
            }
            alone, beside = fn(x16[:1]), fn(x16)[:1]
            out["invariant"].setdefault(kname, True)
            out["invariant"][kname] &= bool(torch.equal(alone, beside))
        out["shapes"][name] = row
        print(f"  {name} [{n}, {k}] done", file=sys.stderr, flush=True)
    for kname in out["invariant"]:
        out["layer_us"][kname] = {
            rows: sum(out["shapes"][s][kname][rows] for s in LAYER) for rows in (1, 16)
        }
    return out


def table(res: dict) -> str:
    lines = [
        "| kernel | 30 layers, 1 row (ms) | 30 layers, 16 rows (ms) | LM head, 1 row (ms) "
        "| LM head, 16 rows (ms) | batch invariant |",
        "|---|---|---|---|---|---|",
    ]
    for kname, layer in res["layer_us"].items():
        head = res["shapes"]["lm_head"][kname]
        lines.append(
            f"| {kname} | {30 * layer[1] / 1e3:.1f} | {30 * layer[16] / 1e3:.1f} | "
            f"{head[1] / 1e3:.2f} | {head[16] / 1e3:.2f} | {res['invariant'][kname]} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeat", type=int, default=100)
    p.add_argument("--out", default=str(ROOT / "results" / "quant_kernel_bench.json"))
    a = p.parse_args()
    res = measure(a.repeat)
    caps = torch.backends.cpu.get_cpu_capability()
    res |= {"command": " ".join(sys.argv), "cpu_capability": caps, "torch": torch.__version__}
    print(f"torch {torch.__version__}, CPU capability {caps}, {torch.get_num_threads()} threads")
    print(table(res))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
