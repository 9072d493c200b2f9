"""The row-wise pieces of a Llama layer: RMSNorm, rotary position embeddings, the split of
the fused QKV projection and SiLU, shared by the model (model.py) and the packed prefill
(packed_prefill.py). In torch, a row's bits can depend on how torch splits an elementwise op
among its threads (SiLU: packed_prefill.py calls it chunk by chunk for that); in C they
depend on that row alone.

`in_c` (the block-quantized CPU engine, whose kernels are built: Llama.fused) runs them in
engine/qmatmul.c, as its decode steps do, rows split among the threads: one pass over the rows
instead of torch's several (RoPE's multiplies, adds and concatenation; SiLU's, then the gate's
product). A burst of 16 x 150-token prompts (bf16 activations, AMX) prefilled in 1.0-1.1 s
with them in torch, 0.76-0.80 s in C.
The C arithmetic rounds differently from torch's (each the same for a row in any batch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagg.engine import quant
from disagg.engine.config import PROMPT_ATTN_ROWS, ModelArgs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, in_c: bool = False) -> torch.Tensor:
    """x: [M, dim] -> [M, dim]."""
    if not in_c:
        return F.rms_norm(x, weight.shape, weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    threads = torch.get_num_threads()
    quant.library().disagg_rms_norm(
        x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr(), threads
    )
    return out


def silu_mul(gate_up: torch.Tensor, in_c: bool = False) -> torch.Tensor:
    """The fused gate and up projection's rows [M, 2 hidden] -> silu(gate) * up [M, hidden]."""
    if not in_c:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate_up = gate_up.contiguous()
    m, hidden = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, hidden, dtype=gate_up.dtype)
    threads = torch.get_num_threads()
    quant.library().disagg_silu_mul(gate_up.data_ptr(), m, hidden, out.data_ptr(), threads)
    return out


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
    args: ModelArgs, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, in_c: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's rows [M, (H + 2 H_kv) D] -> q [M, H, D], k/v [M, H_kv, D], with
    RoPE applied to q and k (cos/sin: [M, 1, D]; in C, qkv, if contiguous, is rotated in
    place). `in_c` needs what fused_decode.supported checks (head_dim <= 512, dims % 8)."""
    a = args
    if in_c:
        qkv = qkv.contiguous()
        m, d = qkv.shape[0], a.head_dim
        c, s = cos.reshape(m, d).contiguous(), sin.reshape(m, d).contiguous()
        quant.library().disagg_rope_rows(
            qkv.data_ptr(), m, a.n_heads, a.n_kv_heads, d, c.data_ptr(), s.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        heads = qkv.view(m, a.n_heads + 2 * a.n_kv_heads, d)
        return heads[:, : a.n_heads], heads[:, a.n_heads : -a.n_kv_heads], heads[:, -a.n_kv_heads :]
    sizes = [(a.n_heads + a.n_kv_heads) * a.head_dim, a.n_kv_heads * a.head_dim]
    # (the ignores: torch leaves Tensor.split unannotated)
    qk, v = qkv.split(sizes, -1)  # type: ignore[no-untyped-call]
    qk = apply_rope(qk.view(-1, a.n_heads + a.n_kv_heads, a.head_dim), cos, sin)
    q, k = qk.split([a.n_heads, a.n_kv_heads], dim=1)  # type: ignore[no-untyped-call]
    return q, k, v.view(-1, a.n_kv_heads, a.head_dim)


def prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    aligned: bool,
    in_c: bool = False,
) -> torch.Tensor:
    """Causal attention of prompt queries q [n, H, D] (positions start..start+n-1) over the
    sequence's keys and values k, v [H_kv, >= start + n, D] (from position 0) -> [n, H * D].
    `in_c` (the block-quantized CPU engine): engine/qmatmul.c, each row with the operations
    a decode step gives a row at its position, so a row's bits depend on its position and the
    cache alone (whole, chunked, after a cached prefix, or decoded). Else `aligned` (a CPU):
    one torch call per block of PROMPT_ATTN_ROWS positions, which sees keys up to its own
    last row; else one call for all n rows (a GPU: one kernel launch)."""
    if in_c:
        return attention_in_c(q, k, v, start, scale)
    end = start + q.shape[0]
    qh = q.transpose(0, 1)[None]  # [1, H, n, D]
    cuts = [start, end]
    if aligned:
        first = start - start % PROMPT_ATTN_ROWS + PROMPT_ATTN_ROWS
        cuts = [start, *range(first, end, PROMPT_ATTN_ROWS), end]
    out = []
    for s, e in zip(cuts[:-1], cuts[1:], strict=True):
        causal = s == 0 and not aligned  # the same mask, for a GPU's fused causal kernel
        visible = None if causal else torch.ones(e - s, e, dtype=torch.bool, device=q.device)
        o = F.scaled_dot_product_attention(
            qh[:, :, s - start : e - start],
            k[None, :, :e],
            v[None, :, :e],
            attn_mask=None if visible is None else visible.tril(diagonal=s),
            is_causal=causal,
            enable_gqa=True,
            scale=scale,
        )  # [1, H, e - s, D]
        out.append(o[0].transpose(0, 1).reshape(e - s, -1))
    return out[0] if len(out) == 1 else torch.cat(out)


def attention_in_c(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    key_blocks: bool = True,
) -> torch.Tensor:
    """prompt_attention `in_c`. `key_blocks` False: the keys as decode reads them, position
    by position (the same bits, slower where the CPU has AVX-512: benchmarks, tests)."""
    n, heads, d = q.shape
    ts = (q, k, v)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in ts) or d % 8:
        raise ValueError("prompt attention in C: fp32 CPU tensors, head_dim a multiple of 8")
    if k.shape[1] < start + n or v.shape[1] < start + n or heads % k.shape[0]:
        raise ValueError("prompt attention in C: keys up to the last row, whole query groups")
    if q.stride(2) != 1 or q.stride(1) != d:  # rows of whole heads (split_qkv's view is)
        q = q.contiguous()
    k, v = (t if t.stride(2) == 1 and t.stride(1) == d else t.contiguous() for t in (k, v))
    if k.stride(0) != v.stride(0) or k.stride(0) % d:
        k, v = k[:, : start + n].contiguous(), v[:, : start + n].contiguous()
    lib, threads = quant.library(), torch.get_num_threads()
    out = torch.empty(n, heads * d)
    scratch = torch.empty(lib.disagg_prompt_scratch(n, start, k.shape[0], d, threads))
    lib.disagg_prompt_attention(
        q.data_ptr(), q.stride(0), n, start, heads, k.shape[0], d, k.data_ptr(), v.data_ptr(),
        k.stride(0) // d, scale, out.data_ptr(), scratch.data_ptr(), threads, int(key_blocks),
    )  # fmt: skip
    return out
