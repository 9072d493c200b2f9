#!/usr/bin/env python3
"""Prepare disagg's TensorRT-LLM deployment for NVIDIA GPUs: per-pool LLM-API options
(TensorRT-LLM's PyTorch backend loads the checkpoint itself), the engine directory the
tokenizer, router and orchestrator read (config.json + tokenizer files, no weights), and
serve.toml for `disagg serve --config`.

    python build_engines/build_trtllm_engine.py --checkpoint checkpoints/Llama-3.1-8B-Instruct \\
        --out engines/llama-8b --dry-run

GPUs: the pools' devices default to the GPUs this machine has (nvidia-smi): prefill on the
first, decode on the next, or both sharing GPU 0 (with KV fractions that fit) on one GPU.
A device list naming a GPU the machine lacks is refused; building elsewhere, say how many the
serving machine has with --num-gpus (disagg serve checks again at start).

Quantization: TensorRT-LLM's PyTorch backend loads weights as the checkpoint stores them, so
--quantization fp8 / int4_awq names what the checkpoint must hold (a ModelOpt export, checked
against its hf_quant_config.json; the error says how to make one), and --kv-cache-dtype fp8
keeps both pools' KV cache in FP8. With GPUs counted here, the pools' GPUs are checked too.

Keep the checkpoint under ./checkpoints and the output under ./engines: serve.toml then holds
paths relative to the checkout, which the compose `gpu` service mounts at the same place.
--dry-run prints every file and changes nothing. Needs no GPU (TensorRT-LLM is only imported
by the serving models).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from disagg.engine.hf import write_serving_metadata
from disagg.errors import ConfigError
from disagg.trtllm import gpus, quantization
from disagg.trtllm.build import TRANSCEIVERS, BuildSpec, PoolSpec, describe, files
from disagg.trtllm.quantization import KV_CACHE_DTYPES, QUANTIZATIONS


def _devices(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"GPU indexes like 0 or 0,1, got {text!r}") from e


def default_devices(world: dict[str, int], num_gpus: int | None) -> dict[str, tuple[int, ...]]:
    """Prefill on the first GPUs, decode on the next; on a machine with too few, decode
    shares from GPU 0 (its count unknown: the next ones, as on two GPUs)."""
    pre, dec = world["prefill"], world["decode"]
    start = pre if num_gpus is None or pre + dec <= num_gpus else 0
    return {"prefill": tuple(range(pre)), "decode": tuple(range(start, start + dec))}


def check_quantization(
    spec: BuildSpec, devices: dict[str, tuple[int, ...]], caps: list[tuple[int, int]] | None
) -> str:
    """The checkpoint against --quantization / --kv-cache-dtype, and the pools' GPUs (`caps`,
    None where not known here) against what they will run: the line the plan prints."""
    if not spec.checkpoint.is_dir():  # (a dry run for elsewhere; the build itself needs it)
        return f"# quantization: not checked, {spec.checkpoint} is not here"
    found = quantization.read_checkpoint(spec.checkpoint)
    quantization.check_checkpoint(found, spec.quantization, spec.kv_cache_dtype, spec.checkpoint)
    needs = quantization.gpu_requirements(found, spec.kv_cache_dtype)
    line = f"# checkpoint: {found.describe()}"
    if needs and caps is None:
        return line + "; not checked against the pools' GPUs (not counted here)"
    if needs and caps is not None:
        quantization.check_gpus(needs, devices, caps)
        line += "; checked against the pools' GPUs"
    return line


def parse(argv: list[str] | None) -> tuple[BuildSpec, bool, str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (under ./engines)")
    p.add_argument("--dtype", default="auto", help="LLM-API dtype (auto: the checkpoint's)")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--transceiver", type=str.upper, choices=TRANSCEIVERS, default="UCX")
    p.add_argument(
        "--num-gpus",
        type=int,
        default=None,
        help="GPUs of the serving machine (default: counted here with nvidia-smi)",
    )
    p.add_argument(
        "--no-kv-reuse",
        action="store_true",
        help="turn KV block reuse (prefix caching) and its events off on both pools",
    )
    for role, batch, tokens in (("prefill", 8, 8192), ("decode", 128, 512)):
        p.add_argument(f"--{role}-max-batch-size", type=int, default=batch)
        p.add_argument(
            f"--{role}-max-num-tokens",
            type=int,
            default=tokens,
            help="tokens per iteration; under --max-seq-len turns on chunked prefill",
        )
        p.add_argument(f"--{role}-tp", type=int, default=1, help="tensor parallel size")
        p.add_argument(f"--{role}-pp", type=int, default=1, help="pipeline parallel size")
        p.add_argument(
            f"--{role}-devices",
            type=_devices,
            default=None,
            help=f"GPU indexes of the {role} pool (default: see above)",
        )
        p.add_argument(f"--{role}-kv-fraction", type=float, default=None,
                       help="free GPU memory for its KV cache (default: 0.85 on its own GPU, "
                            "0.3 prefill / 0.55 decode when they share one)")  # fmt: skip
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                   help="what the checkpoint must hold: fp8 or int4_awq (made with NVIDIA "
                        "ModelOpt: TensorRT-LLM's PyTorch backend quantizes nothing), none, "
                        "or auto (whatever it holds)")  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="fp8: both pools keep the KV cache in FP8; auto: as the checkpoint "
                        "says (16-bit unless it was quantized with an FP8 KV cache)")  # fmt: skip
    p.add_argument("--decode-host-cache-gb", type=float, default=0.0,
                   help="KV cache offload: host memory for blocks evicted from the decode "
                        "pool's GPU memory (0: off)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    a = p.parse_args(argv)
    v = vars(a)
    num_gpus = a.num_gpus if a.num_gpus is not None else gpus.count_gpus()
    world = {r: v[f"{r}_tp"] * v[f"{r}_pp"] for r in ("prefill", "decode")}
    devices = {r: v[f"{r}_devices"] or d for r, d in default_devices(world, num_gpus).items()}
    if num_gpus is None:
        note = "# GPUs: not counted here (no nvidia-smi): disagg serve checks the devices at start"
    else:
        note = f"# GPUs: {num_gpus} on the serving machine"
        for role, ids in devices.items():
            fix = "give GPUs that exist (or --num-gpus for another machine)"
            try:
                gpus.check_exist(list(ids), num_gpus, f"--{role}-devices", fix)
            except ConfigError as e:
                p.error(str(e))

    def pool(role: str) -> PoolSpec:
        return PoolSpec(
            max_batch_size=v[f"{role}_max_batch_size"],
            max_num_tokens=v[f"{role}_max_num_tokens"],
            tensor_parallel=v[f"{role}_tp"],
            pipeline_parallel=v[f"{role}_pp"],
            kv_cache_fraction=v[f"{role}_kv_fraction"],
            devices=devices[role],
            host_cache_gb=a.decode_host_cache_gb if role == "decode" else 0.0,
        )

    try:
        spec = BuildSpec(
            checkpoint=Path(a.checkpoint),
            out_dir=Path(a.out),
            dtype=a.dtype,
            max_seq_len=a.max_seq_len,
            transceiver=a.transceiver,
            kv_reuse=not a.no_kv_reuse,
            quantization=a.quantization,
            kv_cache_dtype=a.kv_cache_dtype,
            prefill=pool("prefill"),
            decode=pool("decode"),
        )
    except ValueError as e:
        p.error(str(e))
    # capabilities of the GPUs counted here; --num-gpus: built for a machine not this one
    caps = gpus.compute_capabilities() if a.num_gpus is None and num_gpus is not None else None
    try:
        note += "\n" + check_quantization(spec, devices, caps)
    except ConfigError as e:
        p.error(str(e))
    return spec, a.dry_run, note


def installed_tensorrt_llm() -> str | None:
    try:
        import tensorrt_llm
    except Exception:  # not in this environment (a build outside the image)
        return None
    return str(tensorrt_llm.__version__)


def main(argv: list[str] | None = None) -> int:
    spec, dry_run, note = parse(argv)
    print(describe(spec))
    print(note)
    if dry_run:
        return 0
    try:
        write_serving_metadata(spec.checkpoint, spec.engine_dir, spec.max_seq_len)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, text in files(spec).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    # what the options were written for (disagg doctor compares it with the serving image)
    record = {
        "tensorrt_llm": installed_tensorrt_llm(),
        "transceiver": spec.transceiver,
        "quantization": spec.quantization,
        "kv_cache_dtype": spec.kv_cache_dtype,
    }
    (spec.out_dir / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"done: python -m disagg serve --config {spec.out_dir / 'serve.toml'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
