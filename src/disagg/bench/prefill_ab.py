"""Whole prefills in one process, two or more ways in turn (an A/B benchmark of a kernel:
benchmarks/prompt_panels_bench.py, key_blocks_bench.py): best of a few rounds each, and
whether every way gave the same logits."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from disagg.engine import packed_prefill


def random_prompts(
    lengths: list[int], packed: int = 16, seed: int = 0
) -> dict[str, list[list[int]]]:
    """One prompt of each length, and `packed` prompts of 150 tokens: name -> token lists"""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    cases = {f"1 x {n}": [prompt(n)] for n in lengths}
    cases[f"{packed} x 150"] = [prompt(150) for _ in range(packed)]
    return cases


def prefill_ab(
    engine: Path,
    cases: dict[str, list[list[int]]],
    ways: dict[str, Callable[[], AbstractContextManager[object]]],
    activations: str = "auto",
    rounds: int = 3,
) -> list[dict[str, object]]:
    """Prefill each case under each way's context (a patch), the ways in turn each round;
    prints a table and returns its rows: seconds `<way>_s` and `same_logits`."""
    from disagg.engine.model import KVCacheSlots, Llama

    model = Llama.load(engine, weights="auto", activations=activations)
    longest = max(len(p) for prompts in cases.values() for p in prompts)
    cache = KVCacheSlots(model.args, max(map(len, cases.values())), longest + 16)
    best: dict[tuple[str, str], float] = {}
    logits: dict[tuple[str, str], torch.Tensor] = {}
    for _ in range(rounds):
        for name, prompts in cases.items():
            for way, patch in ways.items():
                chunks = [packed_prefill.Chunk(p, 0, i) for i, p in enumerate(prompts)]
                with patch():
                    t = time.perf_counter()
                    out = model.prefill_chunks(chunks, cache)
                    dt = time.perf_counter() - t
                best[(name, way)] = min(best.get((name, way), dt), dt)
                logits[(name, way)] = torch.stack(out)
    first, last = next(iter(ways)), list(ways)[-1]
    print(f"\n| prompts | tokens | {' | '.join(f'{w} (s)' for w in ways)} | {last} speed-up "
          "| same logits |")  # fmt: skip
    print("|---|---|" + "---|" * (len(ways) + 2))
    rows = []
    for name, prompts in cases.items():
        times = [best[(name, w)] for w in ways]
        same = all(torch.equal(logits[(name, first)], logits[(name, w)]) for w in ways)
        tokens = sum(map(len, prompts))
        cells = " | ".join(f"{t:.3f}" for t in times)
        print(f"| {name} | {tokens} | {cells} | {times[0] / times[-1]:.2f}x | {same} |")
        rows.append({"prompts": name, "tokens": tokens, "same_logits": same,
                     **{f"{w}_s": best[(name, w)] for w in ways}})  # fmt: skip
    return rows
