#!/usr/bin/env python3
"""What a user gets through the server against what the engine does in one process, per
serving mode, through Triton gRPC (the router model, streamed) and the OpenAI gateway (SSE),
in one run.

Workload (issue 16): 16 streams at once, ~150-token prompts, 64 output tokens each, greedy,
ignore_eos; and one stream alone, 128 tokens, for the inter-token latency (ITL). The engine
reference is the in-process `LLM` on the same prompts (co-located: decode prefills in chunks
beside its batch; and disaggregated: prefill engine -> KV hand-off -> decode engine), and for
the one stream's ITL also the engine's step itself (`engine-step`): `DecodeEngine.step` of
one sequence over the positions the stream decodes, in a process of its own with that model
alone (issue 24: a stream's served ITL within 1.1x of it; this process's in-process `LLM`s
step on threads of their own beside other OpenMP pools, which libgomp makes slower). Each
mode's server is started in turn; inside a mode, engine and entry points take turns round
after round (the median round is reported). During each served 16-stream run the CPU time
of every process is read from /proc: where the time goes.

Prints tables, writes results/served_bench.json and results/served_bench.png.

    python benchmarks/served_bench.py [--modes colocated disaggregated conditional] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from disagg.bench.runner import GatewayTarget, TritonTarget, run_open_loop
from disagg.bench.workloads import PromptMaker, RequestSpec
from disagg.engine.model import Llama
from disagg.engine.sequence import SamplingParams
from disagg.llm import LLM
from disagg.planner.measure import QUICK, measure_decode
from disagg.serve.gateway_process import GatewayProcess
from disagg.serve.server import TritonServer, free_ports
from disagg.serve.supervisor import stub_processes
from disagg.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "served-bench-key"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ per-process CPU
def _cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process so far; 0 if it is gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / CLK_TCK


def cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process, and of every model stub of the one named
    tritonserver (labelled stub:<model>, summed over a model's instances)."""
    out = {name: _cpu(pid) for name, pid in roots.items()}
    for pid, (model, _) in stub_processes(roots["tritonserver"]).items():
        out[f"stub:{model}"] = out.get(f"stub:{model}", 0.0) + _cpu(pid)
    return out


# ------------------------------------------------------------------ the runs
@dataclasses.dataclass
class Run:
    tok_s: float = 0.0
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0
    tokens: int = 0
    errors: int = 0
    cpu_s: dict = dataclasses.field(default_factory=dict)


def _itl(itls: list[float]) -> tuple[float, float]:
    if not itls:
        return 0.0, 0.0
    s = sorted(itls)
    return statistics.median(s) * 1e3, s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3


def engine_run(llm: LLM, prompts: list[str], max_tokens: int) -> Run:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if len(prompts) > 1:
        t = time.perf_counter()
        comps = llm.generate(prompts, params, chat=False)
        tokens = sum(len(c.token_ids) for c in comps)
        return Run(tok_s=tokens / (time.perf_counter() - t), tokens=tokens)
    stamps = [time.perf_counter()]
    for _ in llm.stream(prompts[0], params, chat=False):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]  # after the 1st
    p50, p99 = _itl(gaps)
    return Run(
        tok_s=max_tokens / (stamps[-1] - stamps[0]), itl_p50_ms=p50, itl_p99_ms=p99,
        tokens=max_tokens,
    )  # fmt: skip


def step_times(engine_dir: str, dtype: str, acts: str, prompt_tokens: int, n: int) -> list[float]:
    """The engine's batch-1 step (`DecodeEngine.step`, as `disagg profile` times it) over
    positions prompt_tokens .. + n, on the calling thread: seconds per step."""
    model = Llama.load(engine_dir, compute_dtype=dtype, activations=acts)
    plan = dataclasses.replace(QUICK, batches=(1,), contexts=(prompt_tokens,), decode_steps=n)
    return [seconds for _, _, seconds in measure_decode(model, plan, log=lambda _: None)]


def step_run(a, dtype: str, acts: str, prompt_tokens: int) -> Run:
    """step_times in a process of its own, on its main thread, that model alone: the step a
    decode process can reach (this one holds two engines' thread pools, which slows a step
    here by a third or more)."""
    args = [a.engine_dir, dtype, acts, str(prompt_tokens), str(a.alone_tokens)]
    run = subprocess.run(
        [sys.executable, __file__, "--step-times", *args], capture_output=True, text=True
    )
    if run.returncode:
        raise RuntimeError(f"step timing failed: {run.stderr[-2000:]}")
    times = json.loads(run.stdout.strip().splitlines()[-1])
    p50, p99 = _itl(times)
    return Run(
        tok_s=1 / statistics.median(times), itl_p50_ms=p50, itl_p99_ms=p99, tokens=len(times)
    )


def served_run(target_factory, prompts: list[str], max_tokens: int, roots=None) -> Run:
    specs = [RequestSpec(i, "bench", 0.0, 150, max_tokens, {}) for i in range(len(prompts))]

    async def go():
        target = target_factory()
        try:
            return await run_open_loop(target, specs, lambda s: prompts[s.index])
        finally:
            await target.close()

    before = cpu_seconds(roots) if roots else {}
    t = time.perf_counter()
    timelines = asyncio.run(go())
    wall = time.perf_counter() - t
    after = cpu_seconds(roots) if roots else {}
    ok = [tl for tl in timelines if tl.ok]
    tokens = sum(tl.output_tokens for tl in ok)
    p50, p99 = _itl([x for tl in ok for x in tl.itls()])
    return Run(
        tok_s=tokens / wall, itl_p50_ms=p50, itl_p99_ms=p99, tokens=tokens,
        errors=len(timelines) - len(ok),
        cpu_s={k: round(v - before.get(k, 0.0), 2) for k, v in after.items()} | {"wall": wall},
    )  # fmt: skip


def server_settings(spec: str) -> ServeSettings:
    """ "colocated" or "colocated:decode_stream_interval=2,decode_prefill_chunk=128": a mode
    and settings of its own, over the DISAGG_<SETTING> variables (as for make serve)."""
    mode, _, extra = spec.partition(":")
    env = dict(os.environ, DISAGG_MODE=mode)
    for item in filter(None, extra.split(",")):
        key, _, value = item.partition("=")
        env[f"DISAGG_{key.strip().upper()}"] = value.strip()
    return ServeSettings.load(env=env)


def measure_mode(
    spec: str, a, prompts: list[str], engines: dict[str, LLM], dtype: str, acts: str
) -> dict:
    http, grpc, metrics, gw = free_ports(4)
    settings = dataclasses.replace(
        server_settings(spec),
        engine_dir=a.engine_dir, build_dir=tempfile.mkdtemp(),
        http_port=http, grpc_port=grpc, metrics_port=metrics, gateway_port=gw,
        decode_max_num_seqs=max(16, a.concurrency),
    )  # fmt: skip
    print(f"== {spec}: starting tritonserver and the gateway", flush=True)
    with TritonServer(settings) as server:
        gateway = GatewayProcess(settings, env={"DISAGG_API_KEYS": API_KEY}).start()
        try:
            gateway.wait_ready(timeout_s=60)
            url = server.endpoints.grpc
            targets = {
                "triton-grpc": lambda: TritonTarget(url, "router"),
                "gateway": lambda: GatewayTarget(gateway.url, settings.served_model_name, API_KEY),
            }
            roots = {"tritonserver": server.proc.pid, "gateway": gateway.proc.pid}
            many, one = prompts[: a.concurrency], prompts[:1]
            for f in targets.values():  # warm-up: shared memory, caches, connections
                served_run(f, many, 8)
            rounds = []
            for r in range(a.rounds):
                print(f"   round {r + 1}/{a.rounds}", flush=True)
                rd: dict = {}
                for name, llm in engines.items():
                    rd[f"engine-{name}"] = {
                        "c16": engine_run(llm, many, a.max_tokens),
                        "c1": engine_run(llm, one, a.alone_tokens),
                    }
                llm = engines["colocated"]
                rd["engine-step"] = {  # no 16-stream figure: one sequence's step
                    "c16": Run(),
                    "c1": step_run(a, dtype, acts, len(llm.tokenizer.encode(one[0]))),
                }
                for name, f in targets.items():
                    rd[name] = {
                        "c16": served_run(f, many, a.max_tokens, roots),
                        "c1": served_run(f, one, a.alone_tokens),
                    }
                rounds.append(rd)
        finally:
            gateway.stop()
    return {"settings": dataclasses.asdict(settings), "rounds": rounds}


def median_round(rounds: list[dict]) -> dict:
    """Per entry and load: the run whose tok/s is the median over rounds."""
    out: dict = {}
    for entry in rounds[0]:
        out[entry] = {}
        for load in ("c16", "c1"):
            runs = sorted((rd[entry][load] for rd in rounds), key=lambda r: r.tok_s)
            out[entry][load] = runs[len(runs) // 2]
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary)
    entries = ["engine", "triton-grpc", "gateway"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    w = 0.8 / len(entries)
    for j, entry in enumerate(entries):
        xs = [i + j * w for i in range(len(modes))]
        key = "best_engine" if entry == "engine" else entry
        ax1.bar(xs, [summary[m][key]["c16"].tok_s for m in modes], w, label=entry)
        ax2.bar(xs, [summary[m][key]["c1"].itl_p50_ms for m in modes], w, label=entry)
    labels = [m.replace(":decode_stream_interval=", "\ninterval ") for m in modes]
    for ax, title in ((ax1, "16 streams: output tok/s"), (ax2, "1 stream: ITL p50 (ms)")):
        ax.set_xticks([i + w for i in range(len(modes))], labels, fontsize=8)
        ax.set_title(title)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    if sys.argv[1:2] == ["--step-times"]:  # step_run's own process
        engine_dir, dtype, acts, prompt_tokens, n = sys.argv[2:7]
        print(json.dumps(step_times(engine_dir, dtype, acts, int(prompt_tokens), int(n))))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["colocated", "disaggregated", "conditional"],
        help="servers to run, each a mode with settings of its own if given, e.g. "
        "colocated:decode_stream_interval=2",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--alone-tokens", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "results" / "served_bench.json"))
    a = p.parse_args()
    print("loading the in-process engines ...", flush=True)
    settings = ServeSettings.load()  # DISAGG_COMPUTE_DTYPE etc., as the server takes them
    dtype, acts = settings.compute_dtype, settings.decode_activations
    engines = {
        "colocated": LLM(a.engine_dir, disaggregated=False, compute_dtype=dtype, activations=acts),
        "disaggregated": LLM(
            a.engine_dir, disaggregated=True, compute_dtype=dtype, activations=acts
        ),
    }
    maker = PromptMaker(engines["colocated"].tokenizer, seed=0)
    prompts = [maker.text(150, i) for i in range(a.concurrency)]
    for llm in engines.values():
        engine_run(llm, prompts, 8)  # warm-up
    res: dict = {
        "command": " ".join(sys.argv),
        "threads": torch.get_num_threads(),
        "compute_dtype": engines["colocated"].model.compute_dtype,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("DISAGG_", "OMP_"))},
        "modes": {},
    }
    summary = {}
    for mode in a.modes:
        m = measure_mode(mode, a, prompts, engines, dtype, acts)
        med = median_round(m["rounds"])
        # the engine to match: the faster in-process engine at 16 streams, and for the one
        # stream's ITL the engine's step
        names = [k for k in med if k.startswith("engine-") and k != "engine-step"]
        best = max(names, key=lambda k: med[k]["c16"].tok_s)
        med["best_engine"] = {"c16": med[best]["c16"], "c1": med["engine-step"]["c1"]}
        summary[mode] = med
        res["modes"][mode] = {
            "rounds": [
                {e: {k: dataclasses.asdict(v) for k, v in r.items()} for e, r in rd.items()}
                for rd in m["rounds"]
            ],
            "best_engine": best,
        }
    for e in engines.values():
        e.close()

    print(
        f"\n{a.concurrency} streams x {a.max_tokens} tokens (~150-token prompts) and 1 stream x "
        f"{a.alone_tokens}, greedy, ignore_eos; {res['compute_dtype']}, median of {a.rounds} "
        "rounds"
    )
    print("| mode | entry | tok/s @16 | vs engine | ITL p50/p99 ms @16 | ITL p50 ms @1 | vs step "
          "| errors |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for mode, med in summary.items():
        eng = med["best_engine"]
        for entry, runs in med.items():
            if entry == "best_engine":
                continue
            c16, c1 = runs["c16"], runs["c1"]
            loaded = (
                f"{c16.tok_s:.1f} | {c16.tok_s / eng['c16'].tok_s:.0%} "
                f"| {c16.itl_p50_ms:.0f} / {c16.itl_p99_ms:.0f}"
            )
            print(
                f"| {mode} | {entry} | {'- | - | -' if entry == 'engine-step' else loaded} "
                f"| {c1.itl_p50_ms:.1f} "
                f"| {c1.itl_p50_ms / eng['c1'].itl_p50_ms:.2f}x | {c16.errors + c1.errors} |"
            )
    print(f"\nCPU seconds per process during the {a.concurrency}-stream runs (median round):")
    for mode, med in summary.items():
        for entry in ("triton-grpc", "gateway"):
            cpu = dict(med[entry]["c16"].cpu_s)
            wall = cpu.pop("wall")
            top = sorted(cpu.items(), key=lambda kv: -kv[1])
            cells = ", ".join(f"{k} {v:.1f}" for k, v in top if v >= 0.05)
            cores = len(os.sched_getaffinity(0))
            print(f"  {mode} / {entry} ({wall:.1f} s wall = {cores * wall:.1f} core-s): {cells}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    plot(summary, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
