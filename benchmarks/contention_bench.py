#!/usr/bin/env python3
"""What the engine loses to other processes' CPU: issue 24's closed-loop chat in one process
(no server), alone and beside a background process that keeps a share of a core busy, as
the serving path's processes do (decode's sends, tritonserver, the orchestrator and router
stubs, the gateway, the client: ~0.4 of a core at 16 streams here).

Workload: 16 clients, each sending `--turns` unrelated ~150-token chat prompts in turn (the
next one when the last reply ended), 64 output tokens each, greedy, `ignore_eos`; the
engine's own continuous batching (DecodeEngine.step) with every prompt prefilled beside the
batch, as co-located serving does. The background process runs a busy loop `duty` of every
`--period-ms`; its CPU is read from /proc, so the table shows what it really took.

    python benchmarks/contention_bench.py [--duties 0 0.2 0.4] [--threads 2 1]
        [--activations bfloat16] [--turns 3]

Prints a table; writes results/contention_bench.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from disagg.bench.workloads import PromptMaker
from disagg.engine.config import EngineConfig
from disagg.engine.llm_engine import DecodeEngine
from disagg.engine.model import Llama
from disagg.engine.sequence import SamplingParams
from disagg.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
BUSY = """
import sys, time
duty, period = float(sys.argv[1]), float(sys.argv[2]) / 1e3
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * period:
        pass
    time.sleep(period * (1 - duty))
"""


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / CLK_TCK


def closed_loop(engine: DecodeEngine, prompts: list[list[list[int]]], max_tokens: int) -> dict:
    """Each client's prompts in turn; returns output tok/s and TTFT p50."""
    turn = [0] * len(prompts)
    sent: dict[str, float] = {}

    def send(c: int) -> None:
        rid = f"{c}-{turn[c]}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(rid, params, prompt_ids=prompts[c][turn[c]])
        sent[rid] = time.perf_counter()

    for c in range(len(prompts)):
        send(c)
    tokens, ttft, start = 0, [], time.perf_counter()
    while engine.has_unfinished:
        for out in engine.step():
            now = time.perf_counter()
            tokens += out.token_id is not None
            if out.index == 0 and out.token_id is not None:
                ttft.append(now - sent[out.request_id])
            if out.finish_reason is not None:
                c = int(out.request_id.split("-")[0])
                turn[c] += 1
                if turn[c] < len(prompts[c]):
                    send(c)
    wall = time.perf_counter() - start
    return {"tok_s": tokens / wall, "ttft_p50_s": statistics.median(ttft), "wall_s": wall}


def run(model: Llama, prompts, a, threads: int, duty: float) -> dict:
    torch.set_num_threads(threads)
    config = EngineConfig(max_model_len=2048, max_num_seqs=a.clients, prefault_kv=True)
    engine = DecodeEngine(model, config, set())
    engine.cache.prefaulted.wait()
    bg = None
    if duty > 0:
        cmd = [sys.executable, "-c", BUSY, str(duty), str(a.period_ms)]
        bg = subprocess.Popen(cmd)
        time.sleep(0.3)
    try:
        before = cpu_s(bg.pid) if bg else 0.0
        res = closed_loop(engine, prompts, a.max_tokens)
        bg_cores = (cpu_s(bg.pid) - before) / res["wall_s"] if bg else 0.0
    finally:
        if bg:
            bg.kill()
            bg.wait()
    return {"threads": threads, "duty": duty, "bg_cores": bg_cores, **res}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for threads in sorted({r["threads"] for r in rows}, reverse=True):
        mine = [r for r in rows if r["threads"] == threads]
        ax.plot([r["bg_cores"] for r in mine], [r["tok_s"] for r in mine], "o-",
                label=f"{threads} engine thread(s)")  # fmt: skip
    ax.set_xlabel("cores the background process took")
    ax.set_ylabel("output tok/s (16-client closed loop)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("The engine beside other work, 2 cores")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    p.add_argument("--activations", default="bfloat16")
    p.add_argument("--duties", type=float, nargs="+", default=[0.0, 0.2, 0.4])
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--period-ms", type=float, default=2.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "results" / "contention_bench.json"))
    a = p.parse_args()
    model = Llama.load(a.engine_dir, "auto", "cpu", "auto", a.activations)
    tok = Tokenizer(a.engine_dir)
    maker = PromptMaker(tok, seed=0)
    prompts = [
        [tok.encode_chat([{"role": "user", "content": maker.text(150, 100 * c + t)}])
         for t in range(a.turns)]
        for c in range(a.clients)
    ]  # fmt: skip
    rows = []
    print("| engine threads | background duty | background cores | output tok/s | TTFT p50 (s) |")
    print("|---|---|---|---|---|")
    for threads in a.threads:
        for duty in a.duties:
            r = run(model, prompts, a, threads, duty)
            rows.append(r)
            print(f"| {threads} | {duty:g} | {r['bg_cores']:.2f} | {r['tok_s']:.1f} | "
                  f"{r['ttft_p50_s']:.2f} |", flush=True)  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "activations": model.activations}
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
