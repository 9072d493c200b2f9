#!/usr/bin/env python3
"""The checkpoint's own quantized blocks against the dense fp32 weights they stand for, and
against llama.cpp on the same GGUF (issue 24, step 1), in one run on this machine.

In-process, rounds interleaved (blocks, fp32, blocks, ...; best of `--rounds` per cell):
  - decode step time at 1, 4 and 16 sequences (context ~200 tokens each);
  - prefill time of a 512-token prompt;
  - perplexity on a fixed text, teacher-forced through decode steps (the block kernels);
  - greedy replies on 16 fixed prompts: how many equal fp32's token for token.
On a CPU with AVX512-BF16, also the blocks in bf16 arithmetic (activations bfloat16) and
dense bf16 weights (what a bf16 checkpoint served in bf16 computes).
With `--llama-python` (a Python with llama-cpp-python installed), the same decode cells from
llama.cpp in a subprocess (benchmarks/llamacpp_decode.py), run alone after ours.

    python benchmarks/weights_bench.py [--rounds 3] [--llama-python /path/to/python]

Prints a table; writes results/weights_bench.json and docs/img/weights_bench.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from disagg.bench.quality import PROMPTS, TEXT, greedy, perplexity
from disagg.engine import quant
from disagg.engine.checkpoint import find_packaged_smollm2
from disagg.engine.model import KVCacheSlots, Llama
from disagg.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engines/smollm2-135m-instruct"
BATCHES = (1, 4, 16)
CONTEXT = 200


def cpu_description() -> dict[str, object]:
    flags = set()
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
    keep = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni", "avx_vnni")
    return {"model": model, "flags": sorted(flags & set(keep)), "threads": torch.get_num_threads()}


def step_ms(model: Llama, batch: int, reps: int = 12) -> float:
    cache = KVCacheSlots(model.args, batch, CONTEXT + reps + 8)
    toks = torch.full((batch,), 42)
    for _ in range(3):
        model.decode(toks, torch.full((batch,), CONTEXT), cache)
    start = time.perf_counter()
    for i in range(reps):
        model.decode(toks, torch.full((batch,), CONTEXT + i), cache)
    return (time.perf_counter() - start) / reps * 1000


def prefill_s(model: Llama, n: int = 512) -> float:
    ids = [1000 + (i * 7919) % 40000 for i in range(n)]
    start = time.perf_counter()
    model.prefill(ids)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--llama-python", help="a python with llama-cpp-python, for llama.cpp's cells")
    a = p.parse_args(argv)
    models = {w: Llama.load(ENGINE, weights=w) for w in ("auto", "float32")}
    models["int8"] = Llama.load(ENGINE, weights="auto", activations="int8")
    names = {
        "auto": f"blocks ({models['auto'].weights}), fp32 activations",
        "int8": f"blocks ({models['int8'].weights}), int8 activations",
        "float32": "fp32 (dense)",
    }
    if quant.available() is None and quant.bf16_simd():  # a CPU with AVX512-BF16
        models["bf16"] = Llama.load(ENGINE, weights="auto", activations="bfloat16")
        names["bf16"] = f"blocks ({models['bf16'].weights}), bf16 arithmetic"
        models["dense_bf16"] = Llama.load(ENGINE, weights="bfloat16")
        names["dense_bf16"] = "bf16 (dense, oneDNN)"
    tok = Tokenizer(ENGINE)
    cells: dict[str, dict[str, list[float]]] = {w: {} for w in models}
    for r in range(a.rounds):
        for w, m in models.items():
            for b in BATCHES:
                cells[w].setdefault(f"decode_b{b}_ms", []).append(step_ms(m, b))
            cells[w].setdefault("prefill_512_s", []).append(prefill_s(m))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    best = {w: {k: min(v) for k, v in cells[w].items()} for w in models}
    ids = tok.encode(TEXT)
    for w, m in models.items():
        best[w]["perplexity"] = perplexity(m, ids)
    replies = {w: greedy(m, [tok.encode(q) for q in PROMPTS], 24) for w, m in models.items()}
    same = {
        w: sum(x == y for x, y in zip(replies[w], replies["float32"], strict=True))
        for w in models
        if w != "float32"
    }
    llama: dict[str, float] = {}
    for _ in range(a.rounds if a.llama_python else 0):  # alone, after ours; best of rounds
        script = str(ROOT / "benchmarks/llamacpp_decode.py")
        out = subprocess.run(
            [str(a.llama_python), script, str(find_packaged_smollm2())],
            capture_output=True,
            text=True,
            check=True,
        )
        cells.setdefault("llama.cpp", {})
        for key, value in json.loads(out.stdout.strip().splitlines()[-1]).items():
            if isinstance(value, float):
                cells["llama.cpp"].setdefault(key, []).append(value)
                llama[key] = min(llama.get(key, value), value)
    report(best, names, same, llama)
    result = {
        "machine": cpu_description(),
        "torch": torch.__version__,
        "cells": cells,
        "best": best,
        "greedy_equal_of_16": same,
        "llama_cpp": llama,
        "command": "python benchmarks/weights_bench.py " + " ".join(argv or sys.argv[1:]),
    }
    out_path = ROOT / "results/weights_bench.json"
    out_path.parent.mkdir(exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(best, names, llama, ROOT / "docs/img/weights_bench.png")
    return 0


def report(best: dict, names: dict, same: dict[str, int], llama: dict[str, float]) -> None:
    cols = [f"decode_b{b}_ms" for b in BATCHES] + ["prefill_512_s", "perplexity"]
    print("| weights | " + " | ".join(c.replace("_", " ") for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for w, row in best.items():
        print(f"| {names[w]} | " + " | ".join(f"{row[c]:.3g}" for c in cols) + " |")
    if llama:
        row = " | ".join(f"{llama.get(c, float('nan')):.3g}" for c in cols[:3])
        print(f"| llama.cpp (same GGUF) | {row} | - | - |")
    f = best["float32"]
    for w in same:
        q = best[w]
        print(
            f"\n{names[w]}: batch-1 decode {f['decode_b1_ms'] / q['decode_b1_ms']:.2f}x fp32, "
            f"16 sequences {f['decode_b16_ms'] / q['decode_b16_ms']:.2f}x; perplexity "
            f"{q['perplexity']:.3f} vs {f['perplexity']:.3f}; greedy replies equal on {same[w]}/16"
        )
        if llama:
            print(
                f"  against llama.cpp: batch 1 {llama['decode_b1_ms'] / q['decode_b1_ms']:.2f}x "
                f"its speed, 16 sequences {llama['decode_b16_ms'] / q['decode_b16_ms']:.2f}x"
            )


def plot(best: dict, names: dict, llama: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    series = {names[w]: [best[w][f"decode_b{b}_ms"] / b for b in BATCHES] for w in best}
    if llama:
        series["llama.cpp"] = [llama[f"decode_b{b}_ms"] / b for b in BATCHES]
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(BATCHES))], vals, width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(BATCHES))])
    ax.set_xticklabels([f"{b} sequences" for b in BATCHES])
    ax.set_ylabel("ms per token (decode step / batch)")
    ax.set_title("SmolLM2-135M decode on this CPU: lower is faster")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
