"""`disagg`: one command for everything disagg runs (`python -m disagg` is the same).

    disagg generate --prompt ...   one chat reply, streamed, in this process (no Triton)
    disagg serve                   the whole stack on an embedded tritonserver (make serve)
    disagg gateway                 the OpenAI-compatible gateway alone, in front of a Triton
    disagg status                  a live view of a running server's pools and metrics
    disagg doctor                  check the machine and settings before filing a bug
    disagg cluster                 frontend + 2 prefill + 2 decode servers here (make cluster)
    disagg bench run|compare|report   goodput benchmarks (client/benchmark.py)
    disagg profile                 measure this machine's serving costs into a profile file
    disagg simulate                predict a topology's latencies and goodput from a profile
    disagg plan                    search topologies for the best goodput per node

Each subcommand's options: `disagg <command> --help`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from disagg.engine.config import ACTIVATION_SETTINGS
from disagg.engine.sequence import SamplingParams
from disagg.errors import DisaggError

# subcommand -> (module whose main(argv) runs it, help); imported only when chosen, so
# `disagg generate` never loads the gateway and `disagg status` never loads torch
DELEGATED = {
    "serve": ("disagg.serve.__main__", "serve the model end to end on an embedded tritonserver"),
    "gateway": ("disagg.gateway.__main__", "run the OpenAI-compatible gateway alone"),
    "status": ("disagg.status", "watch a running server (pools, batch, KV, latency)"),
    "doctor": ("disagg.doctor", "check this machine and setup; what to fix for each failure"),
    "cluster": ("disagg.serve.cluster", "a frontend, prefill and decode servers on this machine"),
    "bench": ("disagg.bench.cli", "goodput benchmarks: run, compare, report"),
    "profile": ("disagg.planner.profile_cli", "measure serving costs here into a profile file"),
    "simulate": ("disagg.planner.simulate_cli", "predict topologies' latency and goodput"),
    "plan": ("disagg.planner.plan", "search topologies for the best goodput per node"),
    "planner": ("disagg.planner.autoscale", "the live planner: pool sizes from live metrics"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        code: int = module.main(argv[1:])
        return code
    p = argparse.ArgumentParser(
        prog="disagg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, (_, text) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    g = sub.add_parser("generate", help="stream a chat reply to one prompt")
    g.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    g.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="matmul precision (auto: bfloat16 where the CPU has native bf16, else float32)",
    )
    g.add_argument(
        "--weights",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="auto: the checkpoint's own quantized blocks where their CPU kernels build; "
        "float32 / bfloat16: dense at that precision",
    )
    g.add_argument(
        "--activations",
        choices=ACTIVATION_SETTINGS,
        default="auto",
        help="what the quantized-block products multiply: auto (bfloat16 where the CPU has "
        "AVX512-BF16, else float32), float32, int8 (llama.cpp's scheme; perplexity +0.4%%) "
        "or bfloat16 (fastest, AVX512-BF16 CPUs; prefill's products too; perplexity +0.1%%)",
    )
    g.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N")
    g.add_argument(
        "--co-located",
        action="store_true",
        help="let decode prefill too (default: prefill engine, KV hand-off)",
    )
    a = p.parse_args(argv)
    from disagg.llm import LLM

    try:
        start = time.perf_counter()
        llm = LLM(
            a.engine_dir,
            disaggregated=not a.co_located,
            compute_dtype=a.dtype,
            device=a.device,
            weights=a.weights,
            activations=a.activations,
        )
        params = SamplingParams(
            max_tokens=a.max_tokens,
            temperature=a.temperature,
            top_k=a.top_k,
            top_p=a.top_p,
            seed=a.seed,
        )
        t0 = time.perf_counter()
        first = None
        n = 0
        for delta in llm.stream(a.prompt, params, chat=not a.raw):
            first = first or time.perf_counter()
            n += 1
            print(delta, end="", flush=True)
        end = time.perf_counter()
    except DisaggError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(file=sys.stderr)
    ttft = ((first or end) - t0) * 1000
    print(
        f"[load {t0 - start:.2f}s, TTFT {ttft:.0f} ms, {n} deltas in {end - t0:.2f}s]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
