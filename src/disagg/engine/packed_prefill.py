"""Several prompt chunks in one forward: what `Llama.prefill_chunk` computes for each, bit for
bit, with the matrix products of all of them made together.

A burst of short prompts (16 chat questions of ~150 tokens arriving at once) was prefilled one
prompt after another: 30 layers x 4 products of ~150 rows each. oneDNN's GEMM runs near the
machine's peak only from several hundred rows on (1.5 ms a row at 1,024 rows against 2.0 at
80-150 here), so one product of all the chunks' rows is faster than one per chunk; attention
stays per chunk (each attends over its own slot of the KV cache).

Bit for bit: a row's product does not depend on the other rows of the same kernel (oneDNN's
dense GEMM from two rows on, the block kernels at any count: kernels.py), but a chunk of at
most `model.prompt_rows` rows multiplies blocks alone and a longer one the dense weights. So
the rows go in two groups, chunks that would run on blocks and chunks that would run dense,
each multiplied as one; the last rows' LM head likewise in groups of at most that. Norms,
RoPE, SiLU and the residual adds are row by row. tests/model/test_packed_prefill.py holds it
to `prefill_chunk` with torch.equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from disagg.engine.fused_decode import KVCacheSlots, Llama  # what both read of model.py
from disagg.engine.kernels import BlockLinear, Linear, linear
from disagg.engine.layers import prompt_attention, rms_norm, silu_mul, split_qkv
from disagg.engine.quant import qlinear


@dataclass(frozen=True)
class Chunk:
    """Prompt positions start..start+len(token_ids)-1 of the sequence in `slot`, whose
    positions before `start` are in the cache already."""

    token_ids: list[int]
    start: int
    slot: int


def _grouped(x: torch.Tensor, lin: Linear | BlockLinear, split: int) -> torch.Tensor:
    """linear(x, lin) for rows of chunks that multiply blocks (:split) and of chunks that
    multiply the dense weights (split:), each group as one product: every row meets the
    kernel it meets when its chunk runs alone."""
    if not isinstance(lin, BlockLinear) or lin.dense is None:  # one kernel for every row count
        return linear(x, lin)
    parts = []
    if split:
        parts.append(qlinear(x[:split], lin.blocks))
    if split < x.shape[0]:
        parts.append(linear(x[split:], lin.dense))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def prefill_chunks(model: Llama, chunks: list[Chunk], cache: KVCacheSlots) -> list[torch.Tensor]:
    """The logits of each chunk's last position ([V] each, in the order given); every chunk's
    K/V written into its slot, as `prefill_chunk` would for each."""
    if not chunks or not all(c.token_ids for c in chunks):
        raise ValueError("prefill_chunks: give at least one chunk, each of at least one token")
    if len({c.slot for c in chunks}) < len(chunks):
        raise ValueError("prefill_chunks: one chunk per slot (a later one would read stale K/V)")
    a = model.args
    dev = model.device
    # blocks-sized chunks first: each kernel's rows form one contiguous group
    rows = model.prompt_rows  # past it, a chunk's rows multiply the dense copy
    order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) > rows)
    todo = [chunks[i] for i in order]
    sizes = [len(c.token_ids) for c in todo]
    small = sum(n for n in sizes if n <= rows)
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    ids = [t for c in todo for t in c.token_ids]
    pos = torch.cat([torch.arange(c.start, c.start + len(c.token_ids)) for c in todo]).to(dev)
    cos, sin = model.cos[pos][:, None, :], model.sin[pos][:, None, :]  # [M, 1, D]
    x = model.embed[torch.tensor(ids, device=dev)]  # [M, dim]
    for i, layer in enumerate(model.layers):
        q, k, v = _qkv(model, layer, x, cos, sin, small)
        outs = []
        for c, n, lo in zip(todo, sizes, bounds[:-1], strict=True):
            kc, vc = cache.k[i][c.slot], cache.v[i][c.slot]
            kc[:, c.start : c.start + n] = k[lo : lo + n].transpose(0, 1)
            vc[:, c.start : c.start + n] = v[lo : lo + n].transpose(0, 1)
            qc = q[lo : lo + n]
            outs.append(prompt_attention(qc, kc, vc, c.start, model.scale, True, model.attn_in_c))
        x = x + _grouped(torch.cat(outs), layer.wo, small)
        x = x + _mlp(model, layer, x, small, bounds)
    last = torch.stack([x[b - 1] for b in bounds[1:]])  # [chunks, dim]
    h = rms_norm(last, model.norm, a.norm_eps, model.fused)
    logits = torch.cat(
        [linear(h[j : j + rows], model.lm_head, rows) for j in range(0, len(todo), rows)]
    )
    out: list[torch.Tensor] = [torch.empty(0)] * len(chunks)
    for j, i in enumerate(order):
        out[i] = logits[j]
    return out


def _qkv(
    model: Llama, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, split: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model._qkv with the fused projection made per kernel group."""
    h = rms_norm(x, layer.attn_norm, model.args.norm_eps, model.fused)
    return split_qkv(model.args, _grouped(h, layer.wqkv, split), cos, sin, model.fused)


def _mlp(model: Llama, layer: Any, x: torch.Tensor, split: int, bounds: list[int]) -> torch.Tensor:
    h = rms_norm(x, layer.ffn_norm, model.args.norm_eps, model.fused)
    gate_up = _grouped(h, layer.w13, split)
    if model.fused:  # in C, row by row (layers.py): all rows in one call
        return _grouped(silu_mul(gate_up, True), layer.w2, split)
    # in torch, chunk by chunk: torch splits an elementwise op among its threads by element
    # count and ends each part with a scalar exp, so one call over all rows could round an
    # element differently from the chunk's own call (the same shape and strides as
    # prefill_chunk's)
    act = torch.cat([silu_mul(gate_up[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)])
    return _grouped(act, layer.w2, split)
