"""What building the TensorRT-LLM side means, as data: the LLM-API options of each pool, the
serve settings that point at them, and the engine directory the CPU-side models read.
build_engines/build_trtllm_engine.py prints (--dry-run) or carries out this plan.

TensorRT-LLM's PyTorch backend (the LLM API's default since 1.0) loads the Hugging Face
checkpoint itself; there is no engine build. The legacy TensorRT-engine path (trtllm-build) is
not offered: TensorRT-LLM 1.0's `tensorrt_llm.LLM` is the PyTorch one (engines need
`tensorrt_llm._tensorrt_engine.LLM`), its TensorRT arguments forbid PyTorch-only fields such
as `disable_overlap_scheduler`, and engine directories carry no tokenizer.

Paths in serve.toml are relative to the checkout when they are inside it, so the same file
works on the host and in the compose `gpu` service (which mounts ./engines and ./checkpoints
at the checkout's place in the image, /opt/disagg)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from disagg.settings import ROOT
from disagg.trtllm.quantization import KV_CACHE_DTYPES, QUANTIZATIONS

TRANSCEIVERS = ("UCX", "NIXL", "DEFAULT")  # written uppercase; runtime.py respells per version
SHARED_GPU_FRACTIONS = {"prefill": 0.3, "decode": 0.55}  # both pools on one GPU: sum < 0.9
OWN_GPU_FRACTION = 0.85
# KV cache events kept for a router between reads (what Dynamo's KV-aware routing configures
# for TensorRT-LLM); the oldest go first when nobody reads them
KV_EVENT_BUFFER = 1024


@dataclass(frozen=True)
class PoolSpec:
    """One pool's limits, parallelism and GPUs (prefill and decode differ)."""

    max_batch_size: int
    max_num_tokens: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    kv_cache_fraction: float | None = None  # None: from whether the pools share a GPU
    devices: tuple[int, ...] = (0,)
    host_cache_gb: float = 0.0  # KV blocks offloaded to host memory (0: off)


@dataclass(frozen=True)
class BuildSpec:
    checkpoint: Path  # Hugging Face checkpoint directory
    out_dir: Path
    dtype: str = "auto"
    max_seq_len: int = 4096
    transceiver: str = "UCX"
    # KV block reuse (prefix caching) on both pools, with KV cache events for a router
    kv_reuse: bool = True
    # what the checkpoint must hold (quantization.py: TensorRT-LLM loads it as stored and
    # quantizes nothing; auto: whatever it holds), and the KV cache dtype of both pools
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    prefill: PoolSpec = PoolSpec(max_batch_size=8, max_num_tokens=8192, devices=(0,))
    decode: PoolSpec = field(
        default_factory=lambda: PoolSpec(max_batch_size=128, max_num_tokens=512, devices=(1,))
    )

    def __post_init__(self) -> None:
        if self.transceiver.upper() not in TRANSCEIVERS:
            raise ValueError(f"transceiver must be one of {TRANSCEIVERS}, got {self.transceiver!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv cache dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        for role in ("prefill", "decode"):
            pool = self.pool(role)
            world = pool.tensor_parallel * pool.pipeline_parallel
            if len(pool.devices) != world or len(set(pool.devices)) != world:
                raise ValueError(
                    f"{role}: {world} GPU(s) for tensor x pipeline parallel, "
                    f"but devices {list(pool.devices)}"
                )
            if pool.kv_cache_fraction is not None and not 0 < pool.kv_cache_fraction < 1:
                raise ValueError(f"{role}: kv cache fraction must be in (0, 1)")
        if sum(self.fraction(r) for r in ("prefill", "decode")) >= 0.95 and self.shared_gpu:
            raise ValueError(
                "prefill and decode share a GPU: their KV cache fractions must sum under 0.95 "
                "(each is a fraction of the free memory it finds, and they may load at once)"
            )

    def pool(self, role: str) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode

    @property
    def shared_gpu(self) -> bool:
        return bool(set(self.prefill.devices) & set(self.decode.devices))

    def fraction(self, role: str) -> float:
        given = self.pool(role).kv_cache_fraction
        if given is not None:
            return given
        return SHARED_GPU_FRACTIONS[role] if self.shared_gpu else OWN_GPU_FRACTION

    @property
    def engine_dir(self) -> Path:
        """The tokenizer and architecture numbers the CPU-side models read."""
        return self.out_dir / "disagg"


def llm_api_options(spec: BuildSpec, role: str) -> dict[str, Any]:
    pool = spec.pool(role)
    kv_cache: dict[str, float | int | bool | str] = {
        "free_gpu_memory_fraction": spec.fraction(role),
        # 1.0's default is on; written down so the build says what the pools do, and off
        # with --no-kv-reuse (a prompt's blocks then serve it alone)
        "enable_block_reuse": spec.kv_reuse,
        # 0 keeps no events; upstream emits them only with reuse on
        "event_buffer_max_size": KV_EVENT_BUFFER if spec.kv_reuse else 0,
    }
    if spec.kv_cache_dtype != "auto":
        # 1.0's KvCacheConfig.dtype (PyTorch backend only): fp8 stores both pools' KV cache
        # in FP8 (kv_cache_quant_algo FP8); auto, the default, follows the checkpoint
        kv_cache["dtype"] = spec.kv_cache_dtype
    if pool.host_cache_gb > 0:
        # blocks evicted from GPU memory stay reusable in host memory (secondary pool)
        kv_cache["host_cache_size"] = int(pool.host_cache_gb * 2**30)
    options: dict[str, Any] = {
        "max_batch_size": pool.max_batch_size,
        "max_num_tokens": pool.max_num_tokens,
        "max_seq_len": spec.max_seq_len,
        "tensor_parallel_size": pool.tensor_parallel,
        "pipeline_parallel_size": pool.pipeline_parallel,
        "kv_cache_config": kv_cache,
        # KV moves between the pools' executors through TensorRT-LLM's transceiver
        "cache_transceiver_config": {
            "backend": spec.transceiver.upper(),
            "max_tokens_in_buffer": spec.max_seq_len,
        },
    }
    if spec.dtype != "auto":
        options["dtype"] = spec.dtype
    if pool.max_num_tokens < spec.max_seq_len:
        # a prompt over max_num_tokens is refused unless it is prefilled in chunks: decode
        # prefills co-located and fallback prompts itself, in chunks beside its running batch
        options["enable_chunked_prefill"] = True
    if role == "prefill":
        # context-only executors: TensorRT-LLM's disaggregated examples turn this off there
        options["disable_overlap_scheduler"] = True
    return options


def in_checkout(path: Path) -> str:
    """`path` relative to the checkout when inside it (settings resolve it back), else as is."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def serve_settings(spec: BuildSpec) -> dict[str, str | float]:
    devices = {r: ",".join(map(str, spec.pool(r).devices)) for r in ("prefill", "decode")}
    return {
        "engine_backend": "tensorrt_llm",
        "engine_dir": in_checkout(spec.engine_dir),
        "trtllm_prefill_model": in_checkout(spec.checkpoint),
        "trtllm_decode_model": in_checkout(spec.checkpoint),
        "trtllm_prefill_options": in_checkout(spec.out_dir / "prefill.yaml"),
        "trtllm_decode_options": in_checkout(spec.out_dir / "decode.yaml"),
        "trtllm_prefill_devices": devices["prefill"],
        "trtllm_decode_devices": devices["decode"],
        "decode_max_num_seqs": spec.decode.max_batch_size,
        "max_model_len": spec.max_seq_len,
        # a remote prefill on its own GPU does not slow decode (conditional mode's cost model)
        "conditional_remote_stall": 0.5 if spec.shared_gpu else 0.0,
    }


def files(spec: BuildSpec) -> dict[Path, str]:
    """The pools' LLM-API options and a serve settings file that uses them."""
    out = {
        spec.out_dir / f"{role}.yaml": yaml.safe_dump(llm_api_options(spec, role), sort_keys=False)
        for role in ("prefill", "decode")
    }
    out[spec.out_dir / "serve.toml"] = "".join(
        f"{k} = {v!r}\n" if isinstance(v, (int, float)) else f'{k} = "{v}"\n'
        for k, v in serve_settings(spec).items()
    )
    return out


def outside_checkout(spec: BuildSpec) -> list[Path]:
    """Paths serve.toml names that the compose gpu service will not see."""
    return [p for p in (spec.checkpoint, spec.out_dir) if Path(in_checkout(p)).is_absolute()]


def describe(spec: BuildSpec) -> str:
    lines = [f"# TensorRT-LLM (PyTorch backend) for disagg -> {spec.out_dir}"]
    lines.append(
        f"# quantization: {spec.quantization} (weights as {spec.checkpoint} stores them: "
        f"checked, not made here), KV cache dtype: {spec.kv_cache_dtype}"
    )
    lines.append(
        f"# write {spec.engine_dir}/: config.json and tokenizer files from {spec.checkpoint}"
    )
    for path, text in files(spec).items():
        lines.append(f"# write {path}:")
        lines += ["  " + line for line in text.rstrip().splitlines()]
    for p in outside_checkout(spec):
        lines.append(
            f"# note: {p} is outside the checkout; docker compose's gpu service mounts only "
            "./engines and ./checkpoints"
        )
    return "\n".join(lines)
