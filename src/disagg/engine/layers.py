"""The row-wise pieces of a Llama layer: RMSNorm, rotary position embeddings and the split of
the fused QKV projection. Each row's
result depends on that row alone, so the model (model.py) and the packed prefill
(packed_prefill.py) share them without changing any row's bits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagg.engine.config import ModelArgs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_tables(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_context, D] in HF's `rotate_half` layout (halves repeated), with the
    sign of rotate_half folded into the first half of sin."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(args.max_context, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    sin[:, : d // 2] *= -1
    return emb.cos(), sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [..., D]; cos/sin broadcast to it. rotate_half(x) = [-x2, x1]; the minus is in sin.
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


def split_qkv(
    args: ModelArgs, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's rows [M, (H + 2 H_kv) D] -> q [M, H, D], k/v [M, H_kv, D], with
    RoPE applied to q and k (cos/sin: [M, 1, D])."""
    a = args
    sizes = [(a.n_heads + a.n_kv_heads) * a.head_dim, a.n_kv_heads * a.head_dim]
    # (the ignores: torch leaves Tensor.split unannotated)
    qk, v = qkv.split(sizes, -1)  # type: ignore[no-untyped-call]
    qk = apply_rope(qk.view(-1, a.n_heads + a.n_kv_heads, a.head_dim), cos, sin)
    q, k = qk.split([a.n_heads, a.n_kv_heads], dim=1)  # type: ignore[no-untyped-call]
    return q, k, v.view(-1, a.n_kv_heads, a.head_dim)
