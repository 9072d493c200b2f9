"""The block-quantized matmul kernels (engine/qmatmul.c through engine/quant.py) from plain
numbers: GGML blocks made by gguf-py's own quantizer, checked against gguf-py's dequantize
(the reference the dense engine is built with), against fp32 matmuls, and for batch
invariance bit for bit. No weights, no model; the kernels compile once per machine."""

from __future__ import annotations

import pytest
import torch
from helpers.quant_blocks import FORMATS, blocks

from disagg.engine import quant
from disagg.engine.kernels import BlockLinear, linear, pack
from disagg.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert quant.available() is None, quant.available()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_expanded_blocks_are_exactly_gguf_dequantize(fmt):
    w, ref = blocks(fmt, 96, 160)
    assert torch.equal(quant.dequantize(w), ref)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 64, 65, 130])
def test_matmul_matches_fp32_on_the_dequantized_weight(fmt, rows):
    # n = 74: the last pair of columns (<= 4 rows) is whole, the last group of three (more
    # rows) has two; 73 below gives a half pair and a group of one
    w, ref = blocks(fmt, 74, 192, seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    got, want = quant.qlinear(x, w), x @ ref.T
    assert got.shape == (rows, 74)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n", [130, 131, 73])  # every tail: groups of 3, pairs (module 1, 2)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(fmt, n):
    w, _ = blocks(fmt, n, 224, seed=7)
    x = torch.randn(quant.DIRECT_ROWS, 224, generator=torch.Generator().manual_seed(1))
    full = quant.qlinear(x, w)
    for b in (1, 2, 4, 5, 8, 17, quant.DIRECT_ROWS):  # both kernel paths (<= 4 rows, more)
        assert torch.equal(quant.qlinear(x[:b], w), full[:b]), b
    for i in (0, 9, quant.DIRECT_ROWS - 1):
        assert torch.equal(quant.qlinear(x[i : i + 1], w)[0], full[i])


def test_fused_rows_multiply_as_their_parts():
    (a, _), (b, _) = blocks("q4_1", 40, 64, 1), blocks("q4_1", 24, 64, 2)
    x = torch.randn(3, 64)
    fused = quant.qlinear(x, quant.cat_rows([a, b]))
    assert torch.equal(fused, torch.cat([quant.qlinear(x, a), quant.qlinear(x, b)], dim=1))
    with pytest.raises(ConfigError, match="one quantized format"):
        quant.cat_rows([a, blocks("q8_0", 8, 64)[0]])


def test_block_linear_takes_the_dense_weights_beyond_direct_rows():
    w, ref = blocks("q4_1", 48, 96, 3)
    lin = BlockLinear(w, pack(ref))
    x = torch.randn(quant.DIRECT_ROWS + 1, 96)
    assert torch.equal(linear(x, lin), linear(x, pack(ref)))  # prefill: the dense GEMM
    assert torch.equal(linear(x[:8], lin), quant.qlinear(x[:8], w))  # decode: the blocks


def test_bad_blocks_are_refused_clearly():
    w, _ = blocks("q4_1", 8, 64)
    qs, d, m = w.qs.numpy(), w.d.numpy(), w.m.numpy()
    with pytest.raises(ConfigError, match="must be one of"):
        quant.from_blocks("q5_k", qs, d, m)
    with pytest.raises(ConfigError, match="do not agree"):
        quant.from_blocks("q4_1", qs[:, :1], d, m)
    with pytest.raises(ValueError, match="against weight"):
        quant.qlinear(torch.randn(2, 32), w)


def _attend(qkv, pos, kc, vc, heads, kv_heads, d, rows):
    out = torch.empty(rows, heads * d)
    scratch = torch.empty(rows * heads, kc.shape[2])
    quant.library().disagg_decode_attention(
        qkv.data_ptr(), rows, heads, kv_heads, d, pos.data_ptr(), kc.data_ptr(), vc.data_ptr(),
        kc.shape[2], d**-0.5, out.data_ptr(), scratch.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"), [(9, 3, 64), (8, 1, 80), (4, 4, 64), (6, 2, 8)]
)
def test_decode_attention_matches_softmax_attention_and_is_batch_invariant(heads, kv_heads, d):
    """fused_decode's attention kernel: each row's query heads over its own slot's positions
    0..pos (a kv head's query heads scored together, in runs of up to four), against float64
    softmax attention, and a row's bits the same alone as in the batch."""
    g = torch.Generator().manual_seed(heads * d)
    rows, max_len = 5, 37
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    kc = torch.randn(rows, kv_heads, max_len, d, generator=g)
    vc = torch.randn(rows, kv_heads, max_len, d, generator=g)
    pos = torch.tensor([0, 1, 36, 17, 2], dtype=torch.int64)  # 1, 2, 37, 18, 3 positions
    got = _attend(qkv, pos, kc, vc, heads, kv_heads, d, rows)
    group = heads // kv_heads
    for r in range(rows):
        t = int(pos[r]) + 1
        q = qkv[r, : heads * d].double().view(heads, d)
        k = kc[r, :, :t].double().repeat_interleave(group, 0)  # [heads, t, d]
        v = vc[r, :, :t].double().repeat_interleave(group, 0)
        p = torch.softmax((k @ q[:, :, None])[:, :, 0] * d**-0.5, dim=-1)  # [heads, t]
        want = (p[:, None, :] @ v)[:, 0].reshape(-1).float()
        assert torch.allclose(got[r], want, atol=2e-6, rtol=1e-5), r
        alone = _attend(qkv[r : r + 1].clone(), pos[r : r + 1].clone(), kc[r : r + 1].clone(),
                        vc[r : r + 1].clone(), heads, kv_heads, d, 1)  # fmt: skip
        assert torch.equal(alone[0], got[r]), r


def test_prompt_rows_small_ops_in_c_match_torch_and_are_batch_invariant():
    """layers.py's `in_c` (the block-quantized engine's prefill): RMSNorm, RoPE and SiLU in
    engine/qmatmul.c agree with the torch ops to fp32 rounding, and a row's bits are the same
    alone and among 200 rows (split among the threads from 64 rows on)."""
    from disagg.engine.config import ModelArgs
    from disagg.engine.layers import rms_norm, rope_tables, silu_mul, split_qkv

    g = torch.Generator().manual_seed(3)
    args = ModelArgs(dim=96, n_layers=1, n_heads=6, n_kv_heads=2, hidden_dim=160, vocab_size=32)
    m, width = 200, (6 + 2 * 2) * args.head_dim
    x, w = torch.randn(m, 96, generator=g), torch.rand(96, generator=g) + 0.5
    assert torch.allclose(rms_norm(x, w, 1e-5, True), rms_norm(x, w, 1e-5), atol=1e-5)
    assert torch.equal(rms_norm(x[7:8], w, 1e-5, True)[0], rms_norm(x, w, 1e-5, True)[7])

    cos_t, sin_t = rope_tables(args)
    pos = torch.randint(0, 300, (m,), generator=g)
    cos, sin = cos_t[pos][:, None, :], sin_t[pos][:, None, :]
    qkv = torch.randn(m, width, generator=g)
    got, want = split_qkv(args, qkv.clone(), cos, sin, True), split_qkv(args, qkv, cos, sin)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    alone = split_qkv(args, qkv[9:10].clone(), cos[9:10], sin[9:10], True)
    for a, b in zip(alone, got, strict=True):
        assert torch.equal(a[0], b[9])

    gate_up = torch.randn(m, 2 * 160, generator=g) * 4
    assert torch.allclose(silu_mul(gate_up, True), silu_mul(gate_up), atol=1e-5, rtol=1e-5)
    assert torch.equal(silu_mul(gate_up[5:6], True)[0], silu_mul(gate_up, True)[5])
