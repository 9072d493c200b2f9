#!/usr/bin/env python3
"""Build the TensorRT-LLM side of disagg for NVIDIA GPUs: per-pool LLM-API options (PyTorch
backend, the current path) or, with --backend tensorrt, a context and a generation engine
built with trtllm-build (the legacy path). Writes serve.toml for `make serve CONFIG=...`.

    python build_engines/build_trtllm_engine.py --checkpoint /models/Llama-3.1-8B-Instruct \\
        --out engines/llama-8b-trtllm --prefill-tp 1 --decode-tp 2 --dry-run

--dry-run prints every command and file and changes nothing. Needs TensorRT-LLM (its
NVIDIA container) except for --dry-run and the PyTorch backend's files.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from disagg.trtllm.build import (
    BACKENDS,
    TRANSCEIVERS,
    BuildSpec,
    PoolSpec,
    commands,
    describe,
    files,
)


def parse(argv: list[str] | None) -> tuple[BuildSpec, bool]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--backend", choices=BACKENDS, default="pytorch")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--transceiver", choices=TRANSCEIVERS, default="UCX")
    p.add_argument("--examples-dir", default="/app/tensorrt_llm/examples")
    for role, batch, tokens in (("prefill", 8, 8192), ("decode", 128, 256)):
        p.add_argument(f"--{role}-max-batch-size", type=int, default=batch)
        p.add_argument(f"--{role}-max-num-tokens", type=int, default=tokens)
        p.add_argument(f"--{role}-tp", type=int, default=1, help="tensor parallel size")
        p.add_argument(f"--{role}-pp", type=int, default=1, help="pipeline parallel size")
        p.add_argument(f"--{role}-kv-fraction", type=float, default=0.85)
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    a = p.parse_args(argv)

    def pool(role: str) -> PoolSpec:
        v = vars(a)
        return PoolSpec(
            v[f"{role}_max_batch_size"],
            v[f"{role}_max_num_tokens"],
            v[f"{role}_tp"],
            v[f"{role}_pp"],
            v[f"{role}_kv_fraction"],
        )

    spec = BuildSpec(
        checkpoint=Path(a.checkpoint),
        out_dir=Path(a.out),
        backend=a.backend,
        dtype=a.dtype,
        max_seq_len=a.max_seq_len,
        transceiver=a.transceiver,
        prefill=pool("prefill"),
        decode=pool("decode"),
        examples_dir=Path(a.examples_dir),
    )
    return spec, a.dry_run


def main(argv: list[str] | None = None) -> int:
    spec, dry_run = parse(argv)
    print(describe(spec))
    if dry_run:
        return 0
    if not spec.checkpoint.is_dir():
        print(f"error: checkpoint {spec.checkpoint} is not a directory", file=sys.stderr)
        return 2
    cmds = commands(spec)
    if cmds and shutil.which("trtllm-build") is None:
        print(
            "error: trtllm-build not found: run inside NVIDIA's TensorRT-LLM container",
            file=sys.stderr,
        )
        return 2
    for i, cmd in enumerate(cmds, 1):
        print(
            f"[{i}/{len(cmds)}] {cmd[0]} {cmd[1] if len(cmd) > 1 else ''}",
            file=sys.stderr,
            flush=True,
        )
        subprocess.run(cmd, check=True)
    for path, text in files(spec).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"done: make serve CONFIG={spec.out_dir / 'serve.toml'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
