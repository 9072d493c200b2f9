"""What building the TensorRT-LLM side means, as data: the LLM-API options of each pool, the
commands of the legacy TensorRT engine build, and the serve settings that point at them.
build_engines/build_trtllm_engine.py prints (--dry-run) or carries out this plan."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

BACKENDS = ("pytorch", "tensorrt")  # LLM API on the PyTorch backend (current) | trtllm-build
TRANSCEIVERS = ("UCX", "NIXL")


@dataclass(frozen=True)
class PoolSpec:
    """One pool's engine limits and parallelism (prefill and decode differ)."""

    max_batch_size: int
    max_num_tokens: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    kv_cache_fraction: float = 0.85


@dataclass(frozen=True)
class BuildSpec:
    checkpoint: Path  # Hugging Face checkpoint directory
    out_dir: Path
    backend: str = "pytorch"
    dtype: str = "bfloat16"
    max_seq_len: int = 4096
    transceiver: str = "UCX"
    prefill: PoolSpec = PoolSpec(max_batch_size=8, max_num_tokens=8192)
    decode: PoolSpec = PoolSpec(max_batch_size=128, max_num_tokens=256)
    examples_dir: Path = Path("/app/tensorrt_llm/examples")  # where the TRT-LLM image has them

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.transceiver not in TRANSCEIVERS:
            raise ValueError(f"transceiver must be one of {TRANSCEIVERS}")

    def pool(self, role: str) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode

    def engine_dir(self, role: str) -> Path:
        return self.out_dir / f"{role}_engine"

    def model_for(self, role: str) -> Path:
        """What the pool's LLM loads: the checkpoint, or its own prebuilt engine."""
        return self.checkpoint if self.backend == "pytorch" else self.engine_dir(role)


def llm_api_options(spec: BuildSpec, role: str) -> dict:
    pool = spec.pool(role)
    options = {
        "max_batch_size": pool.max_batch_size,
        "max_num_tokens": pool.max_num_tokens,
        "max_seq_len": spec.max_seq_len,
        "tensor_parallel_size": pool.tensor_parallel,
        "pipeline_parallel_size": pool.pipeline_parallel,
        "kv_cache_config": {"free_gpu_memory_fraction": pool.kv_cache_fraction},
        # KV moves between the pools' executors through TensorRT-LLM's transceiver
        "cache_transceiver_config": {
            "backend": spec.transceiver,
            "max_tokens_in_buffer": spec.max_seq_len,
        },
    }
    if role == "prefill":
        # context-only executors: TensorRT-LLM's disaggregated examples turn this off there
        options["disable_overlap_scheduler"] = True
    return options


def commands(spec: BuildSpec) -> list[list[str]]:
    """The legacy TensorRT backend: a checkpoint conversion and an engine per pool."""
    if spec.backend == "pytorch":
        return []
    out: list[list[str]] = []
    for role in ("prefill", "decode"):
        pool = spec.pool(role)
        converted = spec.out_dir / f"{role}_checkpoint"
        out.append(
            [
                "python3",
                str(spec.examples_dir / "models/core/llama/convert_checkpoint.py"),
                "--model_dir", str(spec.checkpoint),
                "--output_dir", str(converted),
                "--dtype", spec.dtype,
                "--tp_size", str(pool.tensor_parallel),
                "--pp_size", str(pool.pipeline_parallel),
            ]
        )  # fmt: skip
        out.append(
            [
                "trtllm-build",
                "--checkpoint_dir", str(converted),
                "--output_dir", str(spec.engine_dir(role)),
                "--max_batch_size", str(pool.max_batch_size),
                "--max_num_tokens", str(pool.max_num_tokens),
                "--max_seq_len", str(spec.max_seq_len),
                "--gemm_plugin", "auto",
                "--kv_cache_type", "paged",
                "--use_paged_context_fmha", "enable",
                "--remove_input_padding", "enable",
            ]
        )  # fmt: skip
    return out


def files(spec: BuildSpec) -> dict[Path, str]:
    """The pools' LLM-API options and a serve settings file that uses them."""
    out = {
        spec.out_dir / f"{role}.yaml": yaml.safe_dump(llm_api_options(spec, role), sort_keys=False)
        for role in ("prefill", "decode")
    }
    settings = {
        "engine_backend": "tensorrt_llm",
        "instance_kind": "KIND_GPU",
        "trtllm_prefill_model": str(spec.model_for("prefill")),
        "trtllm_decode_model": str(spec.model_for("decode")),
        "trtllm_prefill_options": str(spec.out_dir / "prefill.yaml"),
        "trtllm_decode_options": str(spec.out_dir / "decode.yaml"),
        "decode_max_num_seqs": spec.decode.max_batch_size,
        "max_model_len": spec.max_seq_len,
    }
    out[spec.out_dir / "serve.toml"] = "".join(
        f"{k} = {v!r}\n" if isinstance(v, int) else f'{k} = "{v}"\n' for k, v in settings.items()
    )
    return out


def describe(spec: BuildSpec) -> str:
    lines = [f"# TensorRT-LLM build ({spec.backend} backend) -> {spec.out_dir}"]
    for cmd in commands(spec):
        lines.append(shlex.join(cmd))
    for path, text in files(spec).items():
        lines.append(f"# write {path}:")
        lines += ["  " + line for line in text.rstrip().splitlines()]
    return "\n".join(lines)
