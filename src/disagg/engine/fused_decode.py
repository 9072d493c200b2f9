"""A decode step with the small operations in C (engine/qmatmul.c), for the block-quantized
CPU engine: what `Llama.decode` computes, with each layer's norms, RoPE, K/V store, attention
and SiLU as one call each for all rows instead of ~30 dispatched torch ops (those were ~10 ms
of a 25 ms batch-1 step here; the matmuls are the blocks' own kernels either way).

Each row's arithmetic depends on nothing but that row (batch invariant, like the torch path,
which pads attention to whole blocks for the same reason); it differs from the torch path's
in the order of its sums (attention over exactly a row's own positions, its own softmax), so
decode logits agree with it to ~1e-5, not bit for bit. Prefill's norms and SiLU run these
same C functions, its RoPE the same per-row code (layers.py `in_c`), its attention the same
per-row code too (layers.prompt_attention `in_c`): with bf16 activations, whose block
products round the same at every row count, a token's K/V are the same bits decoded or
prefilled.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from disagg.engine import quant
from disagg.engine.config import ModelArgs
from disagg.engine.kernels import BlockLinear, Linear, linear


class KVCacheSlots(Protocol):
    """What this module reads of model.KVCacheSlots (model.py imports this module)."""

    k: torch.Tensor
    v: torch.Tensor
    max_len: int


class Llama(Protocol):
    """What this module reads of model.Llama."""

    args: ModelArgs
    device: torch.device
    embed: torch.Tensor
    norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    scale: float
    layers: list[Any]  # model.LayerWeights
    lm_head: Linear | BlockLinear
    activations: str  # "float32", "int8" or "bfloat16": what the blocks multiply
    fused: bool  # whether this module runs its decode (and layers.py prompt rows' small ops in C)
    prompt_rows: int  # past this many prompt rows, the blocks' dense copy (kernels.linear)
    attn_in_c: bool  # prompt attention in C, row for row as decode (layers.prompt_attention)


MAX_HEAD_DIM = 512  # qmatmul.c's RoPE buffer


def supported(model: Llama) -> bool:
    """Whether `decode` can run `model`: CPU, every matmul in blocks, kernels built."""
    lins = [lin for layer in model.layers for lin in (layer.wqkv, layer.wo, layer.w13, layer.w2)]
    return (
        model.device.type == "cpu"
        and model.args.head_dim <= MAX_HEAD_DIM
        and model.args.head_dim % 8 == 0
        and model.args.dim % 8 == 0
        and all(isinstance(lin, BlockLinear) for lin in lins)
        and quant.available() is None
    )


def _p(t: torch.Tensor) -> int:
    return t.data_ptr()


def _mm(x: torch.Tensor, lin: Linear | BlockLinear, int8: bool) -> torch.Tensor:
    """The blocks at any batch size (kernels.linear would take the dense copy past
    DIRECT_ROWS rows: a sequence's tokens would then depend on the batch). bf16 rows take the
    AMX tiles where the CPU has them, as prompt rows do: at 16 sequences a step 1.5x faster
    than on the lanes, at 1 sequence 1.3x slower (docs/benchmarks.md); both invariant."""
    if isinstance(lin, BlockLinear):
        return quant.qlinear(x, lin.blocks, "int8" if int8 else lin.activations, tiles=True)
    return linear(x, lin)


@torch.inference_mode()
def decode(
    model: Llama, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCacheSlots
) -> torch.Tensor:
    """`Llama.decode`'s contract: tokens, positions [B] int64 for slots 0..B-1 -> logits [B, V]."""
    a, lib = model.args, quant.library()
    b, dim = tokens.shape[0], a.dim
    pos = positions.to(torch.int64).contiguous()
    threads, int8 = torch.get_num_threads(), model.activations == "int8"
    x = model.embed[tokens].contiguous()  # [B, dim], the residual stream
    h = torch.empty_like(x)
    attn = torch.empty(b, a.n_heads * a.head_dim)
    act = torch.empty(b, a.hidden_dim)
    scores = torch.empty(b * a.n_heads, cache.max_len)
    cos, sin = model.cos, model.sin
    for i, layer in enumerate(model.layers):
        lib.disagg_rms_norm(_p(x), _p(layer.attn_norm), b, dim, a.norm_eps, _p(h), threads)
        qkv = _mm(h, layer.wqkv, int8)  # [B, (H + 2 H_kv) D]
        kc, vc = cache.k[i], cache.v[i]
        lib.disagg_rope_store(
            _p(qkv), b, a.n_heads, a.n_kv_heads, a.head_dim, _p(pos), _p(cos), _p(sin),
            _p(kc), _p(vc), cache.max_len,
        )  # fmt: skip
        lib.disagg_decode_attention(
            _p(qkv), b, a.n_heads, a.n_kv_heads, a.head_dim, _p(pos), _p(kc), _p(vc),
            cache.max_len, model.scale, _p(attn), _p(scores), threads,
        )  # fmt: skip
        x += _mm(attn, layer.wo, int8)
        lib.disagg_rms_norm(_p(x), _p(layer.ffn_norm), b, dim, a.norm_eps, _p(h), threads)
        gate_up = _mm(h, layer.w13, int8)  # (held: a temporary's memory could be reused)
        lib.disagg_silu_mul(_p(gate_up), b, a.hidden_dim, _p(act), threads)
        x += _mm(act, layer.w2, int8)
    lib.disagg_rms_norm(_p(x), _p(model.norm), b, dim, a.norm_eps, _p(h), threads)
    return _mm(h, model.lm_head, False)  # fp32 logits' input: see Llama's docstring
