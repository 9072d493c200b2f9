"""`disagg profile`: measure what serving costs on this machine, with the real engine, and
write a profile file the simulator (`disagg simulate`, `disagg plan`) reads.

    disagg profile [--quick] [--device cuda] [--threads 1] [--out results/profile.json]

--quick measures fewer points once each (about a minute on 2 CPU cores); the default takes
a few minutes. --threads is the torch thread count a pool process would run with (1 for a
core per node, as `disagg bench cluster` pins them; 0: torch's default, all cores).
"""

from __future__ import annotations

import argparse
import sys
import time

from disagg.engine.config import ACTIVATION_SETTINGS
from disagg.errors import ConfigError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disagg profile", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    p.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N")
    p.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="matmul precision, as the pools' compute_dtype setting",
    )  # fmt: skip
    p.add_argument(
        "--weights", choices=("auto", "float32", "bfloat16"), default="auto",
        help="as the weights setting: the checkpoint's quantized blocks where they run, or dense",
    )  # fmt: skip
    p.add_argument(
        "--activations", choices=ACTIVATION_SETTINGS, default="auto",
        help="what the block products multiply, as the decode_activations setting",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="fewer points, once each (~1 minute)")
    p.add_argument("--out", default="results/profile.json", help="the profile file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from disagg.planner.measure import run_profile

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    try:
        profile = run_profile(
            args.engine_dir, args.device, args.dtype, args.weights, args.threads, args.quick, log,
            args.activations,
        )  # fmt: skip
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    profile.save(args.out)
    print(profile.describe())
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s)")
    return 0
