#!/usr/bin/env python3
"""llama.cpp's decode step on a GGUF, in the cells benchmarks/weights_bench.py measures ours:
B sequences (1, 4, 16) of ~200 context tokens each, one token each per step, 2 threads.
Runs under a Python that has llama-cpp-python (its low-level API: one context with a sequence
per slot, each step one `llama_decode` of a B-token batch). Prints one JSON line.

    /path/to/llama-venv/bin/python benchmarks/llamacpp_decode.py model.gguf [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import llama_cpp as L  # (not in disagg's venv: this script runs in another)

BATCHES = (1, 4, 16)
CONTEXT = 200


def fill(batch: L.llama_batch, items: list[tuple[int, int, int, bool]]) -> None:
    """items: (token, position, sequence, wants logits)."""
    batch.n_tokens = len(items)
    for i, (tok, pos, seq, logits) in enumerate(items):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits


def decode(ctx: L.llama_context_p, batch: L.llama_batch) -> None:
    if L.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=12)
    a = p.parse_args(argv)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(a.gguf.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_seq_max, cp.n_ctx, cp.n_batch, cp.n_ubatch = max(BATCHES), 16 * 512, 512, 512
    cp.n_threads = cp.n_threads_batch = a.threads
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(512, 0, 1)
    out: dict[str, object] = {"type": "Q4_1 GGUF", "llama_cpp_python": L.__version__}
    for b in BATCHES:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        for seq in range(b):  # each sequence's context, prefilled
            ids = [1000 + (i * 7919) % 40000 for i in range(CONTEXT)]
            fill(batch, [(t, i, seq, i == CONTEXT - 1) for i, t in enumerate(ids)])
            decode(ctx, batch)
        times = []
        for step in range(a.reps + 3):
            fill(batch, [(42, CONTEXT + step, seq, True) for seq in range(b)])
            start = time.perf_counter()
            decode(ctx, batch)
            times.append(time.perf_counter() - start)
        out[f"decode_b{b}_ms"] = statistics.median(times[3:]) * 1000
        print(f"llama.cpp batch {b}: {out[f'decode_b{b}_ms']:.1f} ms", file=sys.stderr)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
