#!/usr/bin/env python3
"""What keeping a finished sequence's blocks in the prefix cache costs the engine's step,
alone and while another process computes on the same cores (issue 24, step 2: the default
mode's p99 gaps on 2 cores, where a prefill runs beside decode).

A 1,600-token sequence (100 blocks of SmolLM2-135M's K/V, ~74 MB) goes from a decode slot
into the block store, as `KVReuse.keep` does when it finishes: through `KVBlockStore.save`
(one thread, numpy) and through the per-block torch copies it used before (each one a
parallel region of torch's thread pool). "Busy" runs a 2-thread matmul loop in a second
process meanwhile, standing for the prefill. Median and max of --repeat saves each.

    python benchmarks/store_save_bench.py [--blocks 100] [--repeat 9]

Prints a table; writes results/store_save_bench.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from disagg.engine.config import ModelArgs
from disagg.engine.kv_reuse import KVBlockStore

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536,
                    vocab_size=49152)  # fmt: skip


def busy(stop, threads: int) -> None:
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    while not stop.is_set():
        a @ b


def torch_copies(store: KVBlockStore, rows: list[int], k: torch.Tensor, v: torch.Tensor):
    """The save as it was: one torch copy per block and tensor."""
    bs = store.block_size
    for dst, src in ((store.k, k), (store.v, v)):
        for block, pos in enumerate(rows):
            dst[block] = src[:, :, pos * bs : (pos + 1) * bs]


def measure(fn: Callable[[], None], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), max(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2, help="torch threads, each process")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "store_save_bench.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    bs, n = 16, a.blocks
    store = KVBlockStore(SMOLLM2, 2 * n, bs)
    slots = SMOLLM2.n_layers, SMOLLM2.n_kv_heads, n * bs + 64, SMOLLM2.head_dim
    k, v = torch.randn(slots), torch.randn(slots)
    rows = list(range(n))
    ways = {
        "store.save (numpy)": lambda: store.save(rows, rows, k, v),
        "torch per block": lambda: torch_copies(store, rows, k, v),
    }
    mb = 2 * n * store.k[0].numel() * store.k.element_size() / 2**20
    print(f"{n} blocks ({mb:.0f} MB), {a.threads} torch threads, {a.repeat} saves each",
          file=sys.stderr)  # fmt: skip
    results = []
    for load in ("idle", "busy"):
        ctx = mp.get_context("spawn")  # a forked child of an OpenMP pool may hang in it
        stop, proc = ctx.Event(), None
        if load == "busy":
            proc = ctx.Process(target=busy, args=(stop, a.threads), daemon=True)
            proc.start()
            time.sleep(1.0)
        try:
            for way, fn in ways.items():
                fn()  # the store's pages exist from here on
                med, worst = measure(fn, a.repeat)
                results.append({"cores": load, "way": way, "median_ms": 1e3 * med,
                                "max_ms": 1e3 * worst})  # fmt: skip
                print(f"  {load} {way}: median {1e3 * med:.1f} ms", file=sys.stderr)
        finally:
            stop.set()
            if proc is not None:
                proc.join()
    print("| cores | way | median (ms) | max (ms) |\n|---|---|---:|---:|")
    for r in results:
        print(f"| {r['cores']} | {r['way']} | {r['median_ms']:.1f} | {r['max_ms']:.1f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"blocks": n, "megabytes": mb, "threads": a.threads,
                                 "repeat": a.repeat, "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
