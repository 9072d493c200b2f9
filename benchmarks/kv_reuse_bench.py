#!/usr/bin/env python3
"""What the prefix cache's copies cost against the prefill they save (issue 23: "copy cached
blocks in on admission ... decide by measuring"), in the engine, one process.

For prompts of N tokens: the time to prefill them, to keep their blocks (slot -> block
store), and to copy them back into a slot (block store -> slot), which is what a request
whose whole prefix is cached pays instead of the prefill. Median of --repeat runs each.

    python benchmarks/kv_reuse_bench.py [--lengths 256 1024 1536] [--repeat 5]

Prints a table; writes results/kv_reuse_bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from disagg.engine.config import EngineConfig
from disagg.engine.kv_reuse import kv_reuse_for
from disagg.engine.model import KVCacheSlots, Llama

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(model: Llama, config: EngineConfig, cache: KVCacheSlots, n: int, repeat: int) -> dict:
    ids = [(i * 7919) % 40000 + 100 for i in range(n)]
    reuse = kv_reuse_for(model, config)
    assert reuse is not None
    prefill_s = timed(lambda: model.prefill(ids), repeat)
    _, k, v = model.prefill(ids)
    cache.write(0, k, v)

    def keep() -> None:
        reuse.index = type(reuse.index)(config.num_prefix_cache_blocks, config.block_size)
        reuse.save(ids, "", cache.k[:, 0], cache.v[:, 0])

    keep_s = timed(keep, repeat)
    copy_s = timed(lambda: reuse.load_prompt(ids + [1], "", cache, 1), repeat)
    hit = reuse.load_prompt(ids + [1], "", cache, 1).num_cached_tokens
    assert hit == n // 16 * 16 and torch.equal(cache.k[:, 1, :, :hit], cache.k[:, 0, :, :hit])
    return {
        "tokens": n, "kv_mb": n * model.args.kv_bytes_per_token / 1e6,
        "prefill_ms": prefill_s * 1e3, "keep_ms": keep_s * 1e3, "copy_in_ms": copy_s * 1e3,
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 1536])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "results" / "kv_reuse_bench.json"))
    a = p.parse_args()
    model = Llama.load(a.engine_dir, "auto")
    config = EngineConfig(max_num_seqs=2, max_model_len=2048, prefix_cache_tokens=4096)
    cache = KVCacheSlots(model.args, 2, 2048, prefault=True)
    cache.prefaulted.wait()
    rows = [measure(model, config, cache, n, a.repeat) for n in a.lengths]
    print(f"compute dtype {model.compute_dtype}, {torch.get_num_threads()} threads\n")
    print("| prompt tokens | K/V (MB) | prefill (ms) | keep blocks (ms) | copy in (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['kv_mb']:.0f} | {r['prefill_ms']:.0f} | {r['keep_ms']:.1f} | "
              f"{r['copy_in_ms']:.1f} | {r['copy_in_ms'] / r['prefill_ms']:.1%} |")  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
