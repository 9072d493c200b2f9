"""KV pages given before first use: on a thread of their own, without changing a byte that
the engine writes meanwhile (engine/prefault.py)."""

import numpy as np
import pytest

from disagg.engine import prefault as pf

pytestmark = pytest.mark.unit


def resident_pages(a: np.ndarray) -> int:
    """Pages of `a` backed by memory now (mincore over its own pages: a mapping's Rss in
    /proc/self/smaps also counts a neighbouring mapping the kernel merged with it, which
    once made a fresh array read as 27,648 pages resident in a full test run)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = a.ctypes.data // pf.PAGE * pf.PAGE
    length = a.ctypes.data + a.nbytes - start
    vec = ctypes.create_string_buffer(-(-length // pf.PAGE))
    if libc.mincore(start, length, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec.raw)


def fresh_zeros(nbytes: int) -> np.ndarray:
    """float32 zeros in an anonymous mapping of their own, no page touched. (np.zeros of 64
    MiB came back fully resident once in a full test run: the allocator can hand back memory
    a process used before, so its pages say nothing about what prefault did.)"""
    import mmap

    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.float32)


def test_populate_gives_every_page_and_leaves_the_contents(monkeypatch):
    if not pf.populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (older than 5.14): fill() is used")
    a = fresh_zeros(64 << 20)
    assert resident_pages(a) < 16
    a[5] = 7.0  # written by the "engine" before the prefault: kept
    pf.prefault([a]).wait(timeout=30)
    assert resident_pages(a) >= a.nbytes // pf.PAGE - 2
    assert a[5] == 7.0 and not a[:5].any() and not a[6:].any()


def test_without_the_kernel_call_the_pages_are_filled_at_once(monkeypatch):
    monkeypatch.setattr(pf, "_madvise", lambda: None)
    monkeypatch.setattr(pf, "populate_supported", lambda: False)
    a = np.zeros(16 << 20 >> 2, dtype=np.float32)
    done = pf.prefault([a])
    assert done.is_set()  # synchronously: a fill on another thread could race real writes
    assert resident_pages(a) >= a.nbytes // pf.PAGE - 2 and not a.any()
