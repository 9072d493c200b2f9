"""KV hand-off timings by payload size, for each path that exists here. Torch-free.

    pack     KVPayload.pack into a reused buffer: the prefill server, before it answers
    shm      one server: the packed bytes written into a fresh shared-memory file
             (kvshm.ShmHandoffs, as the prefill process packs into it), decode's mapping
             of it (kvshm.open_payload) and KVPayload.from_bytes (header and CRC32 check)
    network  servers apart: the prefill server's lease (a copy), decode's pull over loopback
             TCP from a real kvnet.KVServer, then from_bytes (benchmarks/kv_transfer_bench.py
             times the same steps)

Each sample is [payload bytes, seconds] (median of `reps`). What the emulation leaves out:
Triton's handling of the reply that carries the reference, and on a real network the NIC's
wire time.
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from disagg.engine.config import ModelArgs
from disagg.engine.kv_payload import KVPayload
from disagg.kvnet import KVLeases, KVRef, KVServer, pull
from disagg.kvshm import ShmHandoffs, open_payload
from disagg.planner.profile import Samples


def _median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm: first-touch page faults are not the steady state
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def payload(args: ModelArgs, num_tokens: int) -> KVPayload:
    shape = (args.n_layers, args.n_kv_heads, num_tokens, args.head_dim)
    k = np.random.default_rng(num_tokens).standard_normal(shape, dtype=np.float32)
    return KVPayload.from_arrays(args, k, k.copy())


def measure(args: ModelArgs, tokens: tuple[int, ...], reps: int) -> dict[str, Samples]:
    """{"pack": ..., "shm": ..., "network": ...} samples at each prompt length."""
    out: dict[str, Samples] = {"pack": [], "shm": [], "network": []}
    token = secrets.token_hex(8)
    server = KVServer(KVLeases(capacity_bytes=8 << 30, ttl_s=60.0), token).start()
    try:
        for n in tokens:
            p = payload(args, n)
            buf = np.empty(p.packed_size(), np.uint8)
            packed = p.pack(buf)
            size = float(packed.nbytes)
            out["pack"].append([size, _median_s(lambda: p.pack(buf), reps)])  # noqa: B023
            out["shm"].append([size, _shm_s(packed, reps)])
            out["network"].append([size, _network_s(server, token, packed, reps)])
    finally:
        server.close()
    return out


def _shm_s(packed: npt.NDArray[np.uint8], reps: int) -> float:
    files = ShmHandoffs(capacity_bytes=1 << 40, ttl_s=60.0)

    def run() -> object:
        def fill(out: npt.NDArray[np.uint8]) -> None:
            out[...] = packed  # (pack's own time is the "pack" sample)

        ref = files.write(packed.nbytes, fill)
        if ref is None:  # no room in /dev/shm: what this host would do is the inline path
            raise OSError(f"no shared-memory file of {packed.nbytes} bytes here")
        return KVPayload.from_bytes(open_payload(ref))

    try:
        return _median_s(run, reps)
    finally:
        files.close()


def _network_s(server: KVServer, token: str, packed: npt.NDArray[np.uint8], reps: int) -> float:
    recv = np.empty(packed.nbytes, np.uint8)

    def run() -> object:
        handle = server.leases.put(packed)  # the prefill server's lease (a copy)
        got = pull(KVRef(server.address(), handle, packed.nbytes), token, out=recv)
        return KVPayload.from_bytes(got.data)

    return _median_s(run, reps)
