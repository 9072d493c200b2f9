"""Give a CPU buffer its memory before the first step that writes it, off the critical path.

Touching every page of a decode engine's KV slots (1.5 GB with the defaults) takes about a
second here: page faults and the kernel zeroing each page. A decode instance that does it
in `initialize` is READY a second later after every restart. Linux 5.14+ has
`madvise(MADV_POPULATE_WRITE)`: the kernel maps every page of a range writable, exactly as
a write would, without writing anything. Contents never change, so it can run on a thread
of its own (ctypes releases the GIL) while the engine already serves and writes K/V into
the same pages. Where the kernel lacks it the buffer is filled with zeros at once, as
before (writing zeros into calloc'd memory changes nothing either, but would race with a
real write on another thread, so that path never runs in the background).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

log = logging.getLogger("disagg.engine")
MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); EINVAL on older kernels
PAGE = mmap.PAGESIZE


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _populate(array: np.ndarray[Any, Any]) -> bool:
    """madvise(MADV_POPULATE_WRITE) over the whole pages of `array`; False if refused."""
    fn = _madvise()
    if fn is None:
        return False
    start = -(-array.ctypes.data // PAGE) * PAGE
    end = (array.ctypes.data + array.nbytes) // PAGE * PAGE
    return end <= start or fn(start, end - start, MADV_POPULATE_WRITE) == 0


@functools.cache
def populate_supported() -> bool:
    """Does this kernel populate a range on request? (One page of scratch memory asks.)"""
    return _populate(np.zeros(4 * PAGE // 4, dtype=np.float32))


def prefault(arrays: list[np.ndarray[Any, Any]], background: bool = True) -> threading.Event:
    """Give each of `arrays` its pages; the event is set once they all have them. In the
    background only where the kernel populates without writing; else at once, by zeros."""
    done = threading.Event()
    if not (background and populate_supported()):
        for a in arrays:
            if not _populate(a):
                a.fill(0)
        done.set()
        return done

    def run() -> None:
        try:
            for a in arrays:
                if not _populate(a):  # (an out-of-memory on the way: the first writes fault)
                    log.warning("prefaulting %d MB failed: pages come on use", a.nbytes >> 20)
        finally:
            done.set()

    threading.Thread(target=run, name="kv-prefault", daemon=True).start()
    return done


def prefault_kv(k: torch.Tensor, v: torch.Tensor, enabled: bool) -> threading.Event:
    """`prefault` for a K/V buffer pair where it applies (enabled, in host memory); the
    event is set at once elsewhere (device memory is committed at allocation)."""
    if enabled and k.device.type == "cpu":
        return prefault([k.numpy(), v.numpy()])
    done = threading.Event()
    done.set()
    return done


def zeros_kv(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair of fp32 K/V buffers of `shape`, zeros. On the CPU through numpy's calloc: pages
    cost memory only once written (device memory is committed at allocation)."""
    if device.type == "cpu":
        return (
            torch.from_numpy(np.zeros(shape, dtype=np.float32)),
            torch.from_numpy(np.zeros(shape, dtype=np.float32)),
        )
    k = torch.zeros(shape, dtype=torch.float32, device=device)
    return k, torch.zeros_like(k)
