"""Token sampling: greedy, temperature, top-k, top-p, reproducible by seed.

Randomness is stateless: the draw for a sequence's i-th output token comes from a generator
seeded with (seed, i). So a seeded request gives the same tokens whether its first token was
sampled by a prefill process and the rest by a decode process, and whatever else shares
its batch.
"""

from __future__ import annotations

import torch

from disagg.engine.sequence import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) over the seed space


def token_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed + index * _MIX) % (2**63))


def banned_tokens(params: SamplingParams, history: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens the output has just produced."""
    banned = []
    for word in params.bad_words_ids:
        prefix = list(word[:-1])
        if not prefix or history[-len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned


def sample_one(logits: torch.Tensor, params: SamplingParams, seed: int, history: list[int]) -> int:
    """logits: [V] float32 -> one token id. `history`: the output so far (its length is the
    index of the token drawn now)."""
    index = len(history)
    if params.bad_words_ids and (banned := banned_tokens(params, history)):
        logits = logits.index_fill(0, torch.tensor(banned), float("-inf"))
    if params.is_greedy:
        return int(logits.argmax())
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=token_generator(seed, index)))


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    histories: list[list[int]],
) -> list[int]:
    """logits: [B, V]. Plain greedy rows share one argmax; the others draw one by one."""
    greedy = logits.argmax(-1).tolist()
    return [
        greedy[b]
        if p.is_greedy and not p.bad_words_ids
        else sample_one(logits[b], p, seeds[b], histories[b])
        for b, p in enumerate(params)
    ]
