"""The prefix cache's block store: what it saves from a decode slot (a strided view, any
dtype the KV cache may have) comes back bit for bit, in the rows it was given."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from disagg.engine.config import ModelArgs
from disagg.engine.kv_reuse import KVBlockStore

pytestmark = pytest.mark.unit
ARGS = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_saved_blocks_load_back_bit_for_bit_from_a_slot_view(dtype):
    bs, slots, max_len = 4, 3, 40
    store = KVBlockStore(ARGS, num_blocks=8, block_size=bs)
    store.k, store.v = store.k.to(dtype), store.v.to(dtype)
    shape = (ARGS.n_layers, slots, ARGS.n_kv_heads, max_len, ARGS.head_dim)
    cache_k, cache_v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    k, v = cache_k[:, 1], cache_v[:, 1]  # slot 1: not contiguous, as KVReuse.keep passes it
    assert not k.is_contiguous()
    store.save([5, 2, 7], [0, 3, 1], k, v)  # rows in any order, blocks 0, 3, 1 of the slot
    got_k, got_v = store.load([5, 7, 2])  # blocks 0, 1, 3 one after another
    for got, want in ((got_k, k), (got_v, v)):
        assert got.dtype == dtype
        assert torch.equal(got[:, :, : 2 * bs], want[:, :, : 2 * bs])
        assert torch.equal(got[:, :, 2 * bs :], want[:, :, 3 * bs : 4 * bs])
    assert not store.k[[0, 1, 3, 4, 6]].any()  # rows not named stay empty


def test_a_slot_in_another_dtype_is_converted_not_reinterpreted():
    bs = 4
    store = KVBlockStore(ARGS, num_blocks=2, block_size=bs)  # fp32 rows
    k = torch.randn(ARGS.n_layers, ARGS.n_kv_heads, 2 * bs, ARGS.head_dim).to(torch.bfloat16)
    store.save([1], [1], k, k)
    got, _ = store.load([1])
    assert torch.equal(got, k[:, :, bs:].float())


def _resident_share(t: torch.Tensor) -> float:
    """The share of `t`'s whole pages that are in memory now (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (t.data_ptr() + t.numel() * t.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    vec = (ctypes.c_ubyte * ((end - start) // mmap.PAGESIZE))()
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / len(vec)


def test_a_prefaulted_store_has_its_pages_before_the_first_save(monkeypatch):
    # a decode engine's store (prefault_kv): a step that keeps a sequence must not fault.
    # (Whether a store made without it is resident depends on the allocator's history in
    # this process, so that side is checked by what the store asks for, not by mincore.)
    import disagg.engine.prefault as prefault

    asked: list[int] = []
    real = prefault.prefault

    def spy(arrays):
        asked.extend(a.ctypes.data for a in arrays)
        return real(arrays)

    monkeypatch.setattr(prefault, "prefault", spy)
    args = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, hidden_dim=128, vocab_size=9)
    lazy = KVBlockStore(args, num_blocks=256, block_size=16)
    assert asked == [] and lazy.prefaulted.is_set()
    eager = KVBlockStore(args, num_blocks=256, block_size=16, prefault=True)
    assert asked == [eager.k.data_ptr(), eager.v.data_ptr()]
    assert eager.prefaulted.wait(10)
    assert _resident_share(eager.k) == 1.0 and _resident_share(eager.v) == 1.0
    assert not eager.k.any()  # (and it is still zeros)
