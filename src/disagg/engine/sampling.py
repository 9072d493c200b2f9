"""Token sampling: greedy, temperature, top-k, top-p, reproducible by seed; before that,
the request's own logit adjustments (bad words, min_tokens, logit_bias, penalties).

Randomness is stateless: the draw for a sequence's i-th output token comes from a generator
seeded with (seed, i). So a seeded request gives the same tokens whether its first token was
sampled by a prefill process and the rest by a decode process, and whatever else shares
its batch. Adjustments are as stateless: they read only the row's logits, its prompt and
its output so far, so prefill's first token (output: none yet) and decode's later ones see
what a co-located engine would, and no row's adjustments reach another row.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

from disagg.engine.sequence import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from disagg.engine.grammar import Guide

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


def min_tokens_masked(params: SamplingParams, eos_token_ids: Collection[int]) -> list[int]:
    """The tokens that would end the sequence (EOS unless ignored, stop_token_ids): masked
    while the output is shorter than min_tokens."""
    eos = () if params.ignore_eos else eos_token_ids
    return sorted({*eos, *params.stop_token_ids})


def adjust_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    history: Sequence[int],
    prompt: Sequence[int] = (),
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """logits: [V] -> a new [V] tensor (the input is left alone), in vLLM's order: bad words
    and min_tokens masked, logit_bias added, then the penalties (sequence.py defines them).
    Which tokens count: presence and frequency penalties the output only (`history`);
    repetition_penalty every distinct token of prompt and output, once."""
    if params.bad_words_ids and (banned := banned_tokens(params, list(history))):
        logits = logits.index_fill(0, torch.tensor(banned), float("-inf"))
    if len(history) < params.min_tokens and (masked := min_tokens_masked(params, eos_token_ids)):
        logits = logits.index_fill(0, torch.tensor(masked), float("-inf"))
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias])
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    if params.repetition_penalty != 1.0 and (prompt or history):
        seen = torch.unique(torch.tensor([*prompt, *history]))
        values = logits[seen]
        r = params.repetition_penalty
        logits = logits.index_copy(0, seen, torch.where(values > 0, values / r, values * r))
    if (params.presence_penalty or params.frequency_penalty) and history:
        ids, counts = torch.unique(torch.tensor(list(history)), return_counts=True)
        penalty = params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
        logits = logits.index_add(0, ids, -penalty)
    return logits


def sample_one(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    history: Sequence[int],
    prompt: Sequence[int] = (),
    eos_token_ids: Collection[int] = (),
    guide: Guide | None = None,
) -> int:
    """logits: [V] float32 -> one token id. `history`: the output so far (its length is the
    index of the token drawn now); `prompt` and `eos_token_ids`: what penalties and
    min_tokens read (adjust_logits). `guide`: the request's grammar; only tokens it allows
    are drawn (when it allows none, EOS is returned and the guide is marked dead: the
    scheduler ends the sequence with FinishReason.GRAMMAR)."""
    index = len(history)
    if guide is not None:
        allowed = guide.allowed([*params.guide_tokens, *history], logits.shape[-1])
        if allowed is None:
            return min(eos_token_ids) if eos_token_ids else int(logits.argmax())
        constrained = logits.masked_fill(~torch.from_numpy(allowed), float("-inf"))
        if params.adjusts_logits:  # (min_tokens may mask all the grammar allows: EOS)
            adjusted = adjust_logits(constrained, params, history, prompt, eos_token_ids)
            logits = adjusted if bool(torch.isfinite(adjusted).any()) else constrained
        else:
            logits = constrained
    elif params.adjusts_logits:
        logits = adjust_logits(logits, params, history, prompt, eos_token_ids)
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
    prompts: list[list[int]] | None = None,
    eos_token_ids: Collection[int] = (),
    guides: Sequence[Guide | None] | None = None,
) -> list[int]:
    """logits: [B, V]. Plain greedy rows share one argmax; the others draw one by one, each
    adjusting a copy of its own row only (a neighbour's penalties or grammar never move a
    greedy row)."""
    greedy = logits.argmax(-1).tolist()
    prompts = prompts if prompts is not None else [[] for _ in params]
    guides = guides if guides is not None else [None] * len(params)
    return [
        greedy[b]
        if p.is_greedy and not p.adjusts_logits and guides[b] is None
        else sample_one(logits[b], p, seeds[b], histories[b], prompts[b], eos_token_ids, guides[b])
        for b, p in enumerate(params)
    ]


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    """logits: [B, V], the model's raw logits of the rows whose `tokens` were just sampled ->
    each row's TokenLogprob if its request asked for logprobs (None otherwise). One
    log_softmax over the rows that ask; the others cost nothing."""
    out: list[TokenLogprob | None] = [None] * len(params)
    rows = [b for b, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]
    chosen = logp.gather(1, torch.tensor([[tokens[b]] for b in rows])).squeeze(1).tolist()
    k = max(params[b].logprobs or 0 for b in rows)
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    values, ids = top_v.tolist(), top_i.tolist()
    for r, b in enumerate(rows):
        n = params[b].logprobs or 0
        out[b] = TokenLogprob(chosen[r], tuple(zip(ids[r][:n], values[r][:n], strict=True)))
    return out
