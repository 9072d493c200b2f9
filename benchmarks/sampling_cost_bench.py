#!/usr/bin/env python3
"""What the OpenAI sampling controls cost disagg's decode engine (issue 25, item 6): the mean
decode step at batch 1 and 16 for plain greedy decoding and with a JSON-schema guide,
penalties (presence, frequency, repetition), logprobs (the token's own, and 20
alternatives), every variant on the same prompt, rounds interleaved so the machine's drift
falls on all alike; the best round counts.

    python benchmarks/sampling_cost_bench.py [--rounds 3] [--steps 24]

Prints a table of ms/step (best round) and the cost against plain, and the logprobs
computation timed alone (the engine rows move by several percent between rounds on a shared
2-core machine; the alone figure does not); writes results/sampling_cost.json and
results/sampling_cost.png. Targets (the issue): a JSON guide <= 10% of the step at batch 16,
logprobs <= 5%.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engines/smollm2-135m-instruct"
SCHEMA = json.dumps(
    {"type": "object", "properties": {"name": {"type": "string"}, "bio": {"type": "string"}}}
)
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "json_schema": {"guide_type": "json_schema", "guide": SCHEMA},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "logprobs": {"logprobs": 0},
    "top_logprobs_20": {"logprobs": 20},
}


def step_ms(llm: Any, ids: list[int], batch: int, steps: int, extra: dict[str, Any]) -> float:
    """Mean step (ms) of `batch` sequences decoding together, after all are admitted."""
    from disagg.engine.llm_engine import DecodeEngine
    from disagg.engine.sequence import SamplingParams

    engine = DecodeEngine(llm.model, llm.config, {llm.tokenizer.eos_token_id})
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, **extra)
    for i in range(batch):
        engine.add_request(f"r{i}", params, prompt_ids=ids)
    while engine.scheduler.waiting or any(
        s.prefilling or not s.output_ids for s in engine.scheduler.running
    ):
        engine.step()
    t0, n = time.perf_counter(), 0
    while len(engine.scheduler.running) == batch and n < steps:
        engine.step()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def logprobs_call_ms(batches: list[int], vocab: int, calls: int = 200) -> dict[str, float]:
    """The logprobs computation alone (sampling.token_logprobs on random logits of this
    vocabulary), per step: what the engine rows above include, without their noise."""
    from disagg.engine.sampling import token_logprobs
    from disagg.engine.sequence import SamplingParams

    out = {}
    for batch in batches:
        logits = torch.randn(batch, vocab) * 3
        tokens = logits.argmax(-1).tolist()
        for k in (0, 20):
            params = [SamplingParams(logprobs=k)] * batch
            t0 = time.perf_counter()
            for _ in range(calls):
                token_logprobs(logits, tokens, params)
            out[f"batch {batch}, top {k}"] = round((time.perf_counter() - t0) / calls * 1e3, 3)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["batches"]), figsize=(10, 3.6), squeeze=False)
    for ax, batch in zip(axes[0], result["batches"], strict=True):
        row = result["ms"][str(batch)]
        names = list(row)
        ax.bar(names, [row[n] for n in names], color=["#888"] + ["#3a7"] * (len(names) - 1))
        ax.set_title(f"batch {batch}")
        ax.set_ylabel("ms per decode step")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("decode step cost of sampling controls (best of rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per variant")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--out", default=str(ROOT / "results/sampling_cost.json"))
    args = ap.parse_args()
    from disagg.llm import LLM

    torch.set_num_threads(2)
    llm = LLM(str(ENGINE))
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}]
    ))  # fmt: skip
    best: dict[str, dict[str, float]] = {str(b): {} for b in args.batches}
    runs: dict[str, dict[str, list[float]]] = {str(b): {} for b in args.batches}
    for r in range(args.rounds):
        for batch in args.batches:
            for name, extra in VARIANTS.items():
                ms = step_ms(llm, ids, batch, args.steps, extra)
                row = best[str(batch)]
                row[name] = round(min(row.get(name, ms), ms), 2)
                runs[str(batch)].setdefault(name, []).append(round(ms, 2))
                print(f"round {r + 1}/{args.rounds} batch {batch:>2} {name:<16} {ms:7.1f} ms")
    print(f"\n{'variant':<18}" + "".join(f"{'batch ' + str(b):>22}" for b in args.batches))
    for name in VARIANTS:
        cells = []
        for b in args.batches:
            row = best[str(b)]
            cells.append(f"{row[name]:>9.1f} ms ({(row[name] / row['plain'] - 1) * 100:+5.1f}%)")
        print(f"{name:<18}" + "".join(f"{c:>22}" for c in cells))
    alone = logprobs_call_ms(args.batches, llm.model.args.vocab_size)
    for name, ms in alone.items():
        print(f"token_logprobs alone, {name}: {ms:.3f} ms/step")
    result = {
        "token_logprobs_ms": alone,
        "command": "python benchmarks/sampling_cost_bench.py "
        f"--rounds {args.rounds} --steps {args.steps}",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": 2},
        "weights": llm.model.weights if hasattr(llm.model, "weights") else "",
        "batches": args.batches,
        "ms": best,
        "ms_every_round": runs,
        "cost_pct": {
            str(b): {n: round((v / best[str(b)]["plain"] - 1) * 100, 1) for n, v in row.items()}
            for b, row in ((b, best[str(b)]) for b in args.batches)
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
