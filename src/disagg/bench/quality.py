"""A model's quality on fixed inputs, for the tests and benchmarks that compare two ways of
computing the same model (weights formats, activation precision): greedy replies on 16 fixed
prompts and perplexity on a fixed text, both through decode steps."""

from __future__ import annotations

import math

import torch

from disagg.engine.model import KVCacheSlots, Llama

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "The three primary colors are",
    "A haiku about the sea:",
    "import numpy as np\n",
    "The largest planet in the solar system",
    "Once upon a time, in a small village,",
    "SELECT name FROM users WHERE",
    "The speed of light is",
    "To make a cup of tea, first",
    "Photosynthesis is the process",
    "The French word for cat is",
    "1, 2, 3, 5, 8, 13,",
    "Dear hiring manager,",
    "The opposite of hot is",
]
TEXT = (
    "Prefill reads the whole prompt at once and is bound by arithmetic; decode produces one "
    "token per step for every running sequence and is bound by how fast the weights and the "
    "KV cache stream from memory. Serving both phases in one process wastes one resource or "
    "the other, which is why a disaggregated server gives each phase its own pool of workers "
    "and moves the KV cache between them."
)


def greedy(model: Llama, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens for each prompt, decoded as one batch (batch invariance makes that
    the same as decoding each alone)."""
    cache = KVCacheSlots(model.args, len(prompts), max(map(len, prompts)) + n + 1)
    out = [[int(model.prefill_chunk(ids, 0, cache, i).argmax())] for i, ids in enumerate(prompts)]
    for step in range(n - 1):
        tokens = torch.tensor([o[-1] for o in out])
        pos = torch.tensor([len(ids) + step for ids in prompts])
        for o, t in zip(out, model.decode(tokens, pos, cache).argmax(-1).tolist(), strict=True):
            o.append(int(t))
    return out


def perplexity(model: Llama, ids: list[int]) -> float:
    """Teacher-forced through decode steps: every matmul on the decode path."""
    cache = KVCacheSlots(model.args, 1, len(ids) + 1)
    nll = 0.0
    for i in range(len(ids) - 1):
        logits = model.decode(torch.tensor([ids[i]]), torch.tensor([i]), cache)[0]
        nll -= float(torch.log_softmax(logits, -1)[ids[i + 1]])
    return math.exp(nll / (len(ids) - 1))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Where two token lists part (None: equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
