"""How many OpenMP thread pools a decode process has: one (the engine loop's) where its cores
are its own, two where another engine process computes on them.

GNU libgomp (torch's OpenMP on Linux, and our kernels') keeps a pool of workers for every
thread that starts a parallel region. While a process has more pooled threads than CPUs,
its idle workers spin 100 times instead of 300,000 before they sleep on a futex
(`gomp_throttled_spin_count_var` in libgomp's env.c; GOMP_SPINCOUNT does not raise it), so
every parallel region wakes sleeping workers. A decode step runs hundreds of regions (the
matmuls, norms and attention of every layer).

A decode stub had two pools on two cores: one made by Triton's thread (the model load, the
copies of a KV hand-off) and one by the engine's loop thread, and a batch-1 step on the
loop thread took 11 ms where it took 7-8 ms with one pool. `serial_here()` on Triton's
thread keeps that thread from ever making a pool; the loop thread keeps torch's count.

Spinning is not free where other processes compute on the same cores: a spinning worker
takes CPU they would use. Where another engine process computes on them, decode either
keeps one pool and steps on one thread while that process computes (engine/cpu_share.py,
a prefill pool), or has workers that sleep at once: `pool_here()` makes the
second pool that has libgomp throttle them (prefill_yield.decode_one_pool decides;
docs/benchmarks.md has the figures)."""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import torch

log = logging.getLogger("disagg.engine")

_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # whichever torch loaded, by its file name
_done = threading.local()


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (None: none, or not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(_RUNTIMES):
            try:
                return ctypes.CDLL(path)  # the library already loaded: the same handle
            except OSError:
                continue
    return None


def serial_here() -> bool:
    """Run the calling thread's torch ops and kernels on this thread alone, from now on
    (other threads keep torch's count). True when done; False when no OpenMP runtime is
    loaded (nothing makes pools then). Cheap after the first call on a thread."""
    if getattr(_done, "serial", False):
        return True
    torch.get_num_threads()  # torch's first-use setup on this thread, which would undo ours
    lib = _runtime()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)  # this thread's count (an OpenMP ICV is per thread)
    if torch.get_num_threads() != 1:
        log.warning("could not make this thread's OpenMP work serial")
        return False
    _done.serial = True
    return True


def pool_here() -> None:
    """Start the calling thread's OpenMP pool now (torch's thread count). Beside the engine
    loop's pool, libgomp then manages more threads than CPUs wherever the pools have as many
    threads as there are cores (3 threads on 2 cores), and its idle workers sleep after 100
    spins."""
    torch.ones(1 << 20).add_(1.0)  # over torch's grain: a parallel region when threads > 1
