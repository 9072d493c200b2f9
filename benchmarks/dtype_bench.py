#!/usr/bin/env python3
"""fp32 or bf16 by default? What bf16 changes in greedy replies, whether it stays batch
invariant, and what it gains, on this CPU, in one run.

For each compute dtype the in-process engine (`LLM`, prefill engine -> KV hand-off -> decode
engine) answers a fixed set of chat prompts greedily twice: one prompt at a time, then all
at once (one continuous batch). It reports
  - batch invariance: replies equal token for token alone and in the batch;
  - bf16 against fp32: replies equal, and where they part (the first differing token);
  - speed: output tokens/s of the batched run and of the one-at-a-time run.
Prints a table, writes results/dtype_bench.json (every reply) and results/dtype_bench.png.

    python benchmarks/dtype_bench.py [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from disagg.engine.kernels import bf16_supported
from disagg.engine.sequence import SamplingParams
from disagg.llm import LLM

ROOT = Path(__file__).resolve().parents[1]

# fixed and varied: facts, code, arithmetic, instructions, open-ended writing
PROMPTS = [
    "What is the capital of France? Answer in one word.",
    "Explain in two sentences why prefill and decode want different hardware.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 times 23?",
    "List three primary colors.",
    "Write a haiku about the sea.",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What does a CPU cache do?",
    "Give me a short tip for sleeping better.",
    "Name the planets of the solar system in order.",
    "What is the boiling point of water in Fahrenheit?",
    "Write a SQL query that counts the rows of a table named users.",
    "Why is the sky blue? Keep it short.",
    "Suggest a name for a pet turtle.",
    "What is the difference between a list and a tuple in Python?",
]


def replies(llm: LLM, params: SamplingParams, batched: bool) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    if batched:
        out = llm.generate(PROMPTS, params)
    else:
        out = [llm.generate([p], params)[0] for p in PROMPTS]
    return [c.token_ids for c in out], time.perf_counter() - start


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(engine_dir: str, dtype: str, params: SamplingParams) -> dict:
    print(f"{dtype}: loading ...", flush=True)
    llm = LLM(engine_dir, compute_dtype=dtype)
    try:
        llm.generate(PROMPTS[:2], params)  # warm-up
        print(f"{dtype}: {len(PROMPTS)} prompts one at a time ...", flush=True)
        alone, alone_s = replies(llm, params, batched=False)
        print(f"{dtype}: {len(PROMPTS)} prompts in one batch ...", flush=True)
        batch, batch_s = replies(llm, params, batched=True)
        text = [llm.tokenizer.decode(t) for t in alone]
    finally:
        llm.close()
    return {
        "alone": alone,
        "batch": batch,
        "text": text,
        "invariant": sum(a == b for a, b in zip(alone, batch, strict=False)),
        "alone_tok_s": sum(map(len, alone)) / alone_s,
        "batch_tok_s": sum(map(len, batch)) / batch_s,
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diffs = res["bf16_vs_fp32"]["first_difference"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = [d if d is not None else res["max_tokens"] for d in diffs]
    colors = ["tab:green" if d is None else "tab:orange" for d in diffs]
    ax.bar(range(len(xs)), xs, color=colors)
    ax.set_xlabel("prompt")
    ax.set_ylabel("first token bf16 differs")
    ax.set_title("bf16 vs fp32 greedy replies (green: equal throughout)")
    ax.set_ylim(0, res["max_tokens"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "results" / "dtype_bench.json"))
    a = p.parse_args()
    if not bf16_supported():
        print("this CPU has no native bf16: float32 is the only choice (and the default)")
        return 0
    params = SamplingParams(max_tokens=a.max_tokens)  # greedy, stops at EOS
    res = {"command": " ".join(sys.argv), "threads": torch.get_num_threads()}
    res["max_tokens"] = a.max_tokens
    res["prompts"] = PROMPTS
    for dtype in ("float32", "bfloat16"):
        res[dtype] = measure(a.engine_dir, dtype, params)
    f32, b16 = res["float32"], res["bfloat16"]
    diffs = [first_difference(x, y) for x, y in zip(f32["alone"], b16["alone"], strict=False)]
    parted = [d for d in diffs if d is not None]
    res["bf16_vs_fp32"] = {
        "equal": diffs.count(None),
        "first_difference": diffs,
        "median_first_difference": statistics.median(parted) if parted else None,
    }
    n = len(PROMPTS)
    print(f"\n{n} prompts, greedy, up to {a.max_tokens} tokens, {res['threads']} threads")
    print("| dtype | batch invariant | equal to fp32 | tok/s one at a time | tok/s batched |")
    print("|---|---|---|---|---|")
    for name, r, eq in (("float32", f32, n), ("bfloat16", b16, res["bf16_vs_fp32"]["equal"])):
        print(
            f"| {name} | {r['invariant']}/{n} | {eq}/{n} | {r['alone_tok_s']:.1f} "
            f"| {r['batch_tok_s']:.1f} |"
        )
    print(
        f"bf16 replies part from fp32 at tokens {sorted(parted)} "
        f"(median {res['bf16_vs_fp32']['median_first_difference']})"
    )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
