"""Prompt attention by aligned row blocks (engine/layers.py): a prompt's rows get the same
bits computed whole, in chunks, or after a cached prefix, wherever those start at multiples
of PROMPT_ATTN_ROWS; and decode's chunk sizes are cut to end there."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from disagg.cpuinfo import cpu_flags
from disagg.engine import quant
from disagg.engine.config import PROMPT_ATTN_ROWS, aligned_chunk
from disagg.engine.layers import attention_in_c, prompt_attention

pytestmark = pytest.mark.unit

H, H_KV, D = 9, 3, 64  # SmolLM2's heads
R = PROMPT_ATTN_ROWS


def _qkv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, H, D, generator=g),
        torch.randn(H_KV, n, D, generator=g),
        torch.randn(H_KV, n, D, generator=g),
    )


@pytest.mark.parametrize("n", [35, 150, 600])
def test_rows_after_a_cached_prefix_or_in_chunks_equal_the_whole_prompts_bit_for_bit(n):
    q, k, v = _qkv(n, n)
    whole = prompt_attention(q, k, v, 0, 0.125, aligned=True)
    for start in (s for s in (R, 2 * R, 6 * R) if s < n):  # a cached prefix, then the rest
        rest = prompt_attention(q[start:], k, v, start, 0.125, aligned=True)
        assert torch.equal(rest, whole[start:]), start
    cuts = [c for c in (0, 2 * R, 3 * R, 7 * R) if c < n] + [n]  # as decode cuts them
    parts = [prompt_attention(q[a:b], k, v, a, 0.125, True) for a, b in pairwise(cuts)]
    assert torch.equal(torch.cat(parts), whole)


def test_it_is_causal_attention():
    """Against softmax(q k^T) v written out, and against one call for all rows."""
    q, k, v = _qkv(40, 7)
    got = prompt_attention(q, k, v, 0, 0.125, aligned=True).view(40, H, D)
    kk, vv = k.repeat_interleave(H // H_KV, 0), v.repeat_interleave(H // H_KV, 0)
    s = torch.einsum("qhd,hkd->hqk", q, kk) * 0.125
    s = s.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
    want = torch.einsum("hqk,hkd->qhd", s.softmax(-1), vv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    one_call = prompt_attention(q, k, v, 0, 0.125, aligned=False).view(40, H, D)
    torch.testing.assert_close(one_call, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("start", "n", "prompt_len", "want"),
    [
        (0, 64, 1000, 64),  # already ends on a block
        (0, 70, 1000, 64),  # cut back to the block's end
        (32, 40, 1000, 32),  # from a cached prefix: ends at 64
        (64, 10, 1000, 10),  # cutting would leave nothing: as asked
        (64, 40, 104, 40),  # ends the prompt: as asked
        (5, 20, 1000, 11),  # an unaligned start still ends on a block
    ],
)
def test_decode_chunks_end_where_the_row_blocks_do(start, n, prompt_len, want):
    assert aligned_chunk(start, n, prompt_len) == want


def _decode_rows(q, k, v, start):
    """What fused_decode's attention gives row r of q, decoded at position start + r."""
    lib, n = quant.library(), q.shape[0]
    width = (H + 2 * H_KV) * D
    out = torch.empty(n, H * D)
    for r in range(n):
        qkv = torch.zeros(1, width)
        qkv[0, : H * D] = q[r].reshape(-1)
        scratch = torch.empty(H, k.shape[1])
        row = torch.empty(1, H * D)
        pos = torch.tensor([start + r], dtype=torch.int64)
        lib.disagg_decode_attention(
            qkv.data_ptr(), 1, H, H_KV, D, pos.data_ptr(), k.data_ptr(), v.data_ptr(),
            k.shape[1], 0.125, row.data_ptr(), scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        out[r] = row[0]
    return out


@pytest.mark.parametrize("n", [1, 35, 150])
def test_rows_in_c_equal_decode_steps_bit_for_bit_however_they_are_cut(n):
    """The C rows: a prompt's rows whole, in chunks of any size (no block alignment),
    after any cached prefix, and decoded one by one: one set of bits."""
    assert quant.available() is None, quant.available()
    q, k, v = _qkv(n, 100 + n)
    whole = prompt_attention(q, k, v, 0, 0.125, aligned=False, in_c=True)
    assert torch.equal(whole, _decode_rows(q, k, v, 0))
    cuts = sorted({0, *(c for c in (1, 7, 23, 64, 101) if c < n), n})
    parts = [prompt_attention(q[a:b], k, v, a, 0.125, False, in_c=True) for a, b in pairwise(cuts)]
    assert torch.equal(torch.cat(parts), whole)
    # strided views, as the model passes them: q rows of the fused projection, a cache slot
    qkv = torch.randn(n, (H + 2 * H_KV) * D)
    qkv[:, : H * D] = q.reshape(n, -1)
    slot_k = torch.zeros(H_KV, n + 9, D)
    slot_v = torch.zeros(H_KV, n + 9, D)
    slot_k[:, :n], slot_v[:, :n] = k, v
    viewed = qkv.view(n, H + 2 * H_KV, D)[:, :H]
    assert torch.equal(prompt_attention(viewed, slot_k, slot_v, 0, 0.125, False, True), whole)
    torch.testing.assert_close(
        whole, prompt_attention(q, k, v, 0, 0.125, aligned=False), rtol=1e-5, atol=1e-5
    )


def test_rows_in_c_refuse_what_the_kernel_cannot_read():
    q, k, v = _qkv(8, 3)
    with pytest.raises(ValueError, match="head_dim a multiple of 8"):
        prompt_attention(q[..., :60], k[..., :60], v[..., :60], 0, 0.125, False, in_c=True)
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        prompt_attention(q, k, v.double(), 0, 0.125, False, in_c=True)
    with pytest.raises(ValueError, match="keys up to the last row"):
        prompt_attention(q, k[:, :4], v[:, :4], 0, 0.125, False, in_c=True)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "n", "start"),
    [
        (9, 3, 64, 50, 0),  # SmolLM2: three heads of a kv head scored together
        (6, 3, 64, 9, 3),  # two a kv head; rows two by two from an odd position, one left
        (3, 3, 64, 12, 0),  # one a kv head
        (8, 2, 64, 33, 0),  # four a kv head: scored two and two
        (4, 4, 24, 17, 0),  # one a kv head; a value row shorter than 64 lanes
        (6, 3, 72, 16, 5),  # after a cached prefix: 21 positions, a block and a part
        (2, 1, 80, 1, 14),  # one row at position 14: 64 lanes and 16 more
        (9, 3, 128, 20, 0),  # head_dim 128: a value row in two passes of 64 lanes
        (12, 2, 64, 19, 7),  # six a kv head: runs of four and two, the second from head 4
    ],
)
def test_key_blocks_give_the_keys_own_bits_at_every_shape(heads, kv_heads, d, n, start):
    """Rows scored against blocks of keys and attending two by two (AVX-512), or position by
    position and one by one, as decode reads the cache: one set of bits, at every block tail
    and head grouping; causal attention."""
    g = torch.Generator().manual_seed(heads * 100 + d)
    q = torch.randn(n, heads, d, generator=g)
    k, v = (torch.randn(kv_heads, start + n, d, generator=g) for _ in range(2))
    blocks = attention_in_c(q, k, v, start, 0.125, key_blocks=True)
    assert torch.equal(blocks, attention_in_c(q, k, v, start, 0.125, key_blocks=False))
    threads = torch.get_num_threads()
    try:  # each thread its own score rows: other counts, other splits, the same bits
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            assert torch.equal(blocks, attention_in_c(q, k, v, start, 0.125)), n_threads
    finally:
        torch.set_num_threads(threads)
    group = heads // kv_heads
    kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = torch.einsum("qhd,hkd->hqk", q, kk) * 0.125
    visible = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
    want = torch.einsum("hqk,hkd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(blocks.view(n, heads, d), want, rtol=1e-5, atol=1e-5)


def test_key_blocks_are_built_where_the_cpu_has_avx512():
    """Else the test above compares a path with itself."""
    has = "avx512f" in cpu_flags().split()
    assert quant.library().disagg_prompt_key_blocks() == int(has)
