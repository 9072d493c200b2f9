#!/usr/bin/env python3
"""The KV hand-off over the network (disagg.kvnet) against the same-host path's work, per
prompt length, on this machine: a real KVServer on loopback and a real pull.

Per row: pack (prefill writes the payload), lease (the prefill server's copy), pull (TCP,
prefill server -> decode server), verify (decode's header + CRC32 check), and the wire
GB/s of the pull alone. The same-host path does pack + verify plus Triton's shared-memory
copies (measured end to end by benchmarks/serving_bench.py: 47.2 MB in 60-85 ms).

    python benchmarks/kv_transfer_bench.py [--reps 5] [--out results]
Prints a table and writes <out>/kv_transfer_bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from disagg.engine.config import ModelArgs
from disagg.engine.kv_payload import KVPayload
from disagg.kvnet import KVLeases, KVRef, KVServer, pull

SMOLLM2 = ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536,
                    vocab_size=49152)  # fmt: skip
TOKEN = "bench"


def timed(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="128,512,1024,2048")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("results"))
    a = p.parse_args(argv)
    server = KVServer(KVLeases(capacity_bytes=4 << 30), TOKEN).start()
    rows = []
    for n in (int(x) for x in a.tokens.split(",")):
        shape = (SMOLLM2.n_layers, SMOLLM2.n_kv_heads, n, SMOLLM2.head_dim)
        k = np.random.default_rng(n).standard_normal(shape, dtype=np.float32)
        payload = KVPayload.from_arrays(SMOLLM2, k, k.copy())
        buf = np.empty(payload.packed_size(), np.uint8)
        recv = np.empty(payload.packed_size(), np.uint8)
        t_pack, packed = timed(lambda: payload.pack(buf), a.reps)  # noqa: B023
        t_lease, _ = timed(lambda: server.leases.drop(server.leases.put(packed)), a.reps)  # noqa: B023
        pulls = []
        for _ in range(a.reps):
            ref = KVRef(server.address(), server.leases.put(packed), packed.nbytes)
            t = time.perf_counter()
            got = pull(ref, TOKEN, out=recv)
            pulls.append(time.perf_counter() - t)
        t_pull = statistics.median(pulls)
        t_verify, _ = timed(lambda: KVPayload.from_bytes(got), a.reps)  # noqa: B023
        mb = packed.nbytes / 1e6
        rows.append({
            "tokens": n, "MB": round(mb, 1), "pack_ms": round(t_pack * 1e3, 2),
            "lease_ms": round(t_lease * 1e3, 2), "pull_ms": round(t_pull * 1e3, 2),
            "verify_ms": round(t_verify * 1e3, 2),
            "wire_GBps": round(mb / 1e3 / t_pull, 2),
            "network_total_ms": round((t_pack + t_lease + t_pull + t_verify) * 1e3, 1),
        })  # fmt: skip
    server.close()
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "kv_transfer_bench.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
