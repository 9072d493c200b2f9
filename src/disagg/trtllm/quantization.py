"""Quantization on the GPU path: what the build offers (`--quantization`, `--kv-cache-dtype`),
what a checkpoint holds, and whether the two and the GPUs agree.

TensorRT-LLM 1.0's PyTorch backend does not quantize weights: it loads them as the checkpoint
stores them. A quantized checkpoint says so in NVIDIA ModelOpt's `hf_quant_config.json`
({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", ...}}), which 1.0 reads
in llmapi/llm_utils.py (ModelLoader._update_from_hf_quant_config) and _torch/model_config.py
(ModelConfig.from_pretrained); failing that, config.json's `quantization_config`, of which the
PyTorch path loads only block-scaled FP8 (DeepSeek's) and MXFP4, anything else raising
NotImplementedError. `LLM(quant_config=...)` quantizes on the TensorRT-engine backend only:
1.0's TorchLlmArgs has no such field (a private attribute, so a `quant_config` key in the
options is refused as an extra input, and upstream's loader logs "QuantConfig for pytorch
backend is ignored"). So `--quantization fp8` quantizes nothing: it says what the checkpoint
must hold, the build checks it, and a checkpoint not quantized yet is made with ModelOpt
(`make_with_modelopt`, docs/gpu.md).

The KV cache is another matter: `kv_cache_config.dtype: fp8` stores it in FP8 at run time,
quantized checkpoint or not (TorchLlmArgs.sync_quant_config_with_kv_cache_config_dtype sets
kv_cache_quant_algo FP8); `auto` follows the checkpoint (ModelOpt's hf_ptq.py writes FP8 KV
by default). Both pools take one setting: the cache transceiver moves blocks as stored, and a
pair of different KV dtypes is refused (later releases' CacheFormatter::inquireSupport) or
misread."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from disagg.errors import ConfigError


@dataclass(frozen=True)
class Scheme:
    """One `--quantization` choice."""

    quant_algo: str | None  # QuantAlgo as hf_quant_config.json spells it; None: unquantized
    qformat: str  # ModelOpt hf_ptq.py --qformat that makes such a checkpoint


SCHEMES = {
    "none": Scheme(None, ""),
    "fp8": Scheme("FP8", "fp8"),  # per-tensor FP8 weights and activations
    "int4_awq": Scheme("W4A16_AWQ", "int4_awq"),  # INT4 weights in groups of 128, 16-bit math
}
QUANTIZATIONS = ("auto", *SCHEMES)  # auto: whatever the checkpoint holds
KV_CACHE_DTYPES = ("auto", "fp8")  # KvCacheConfig.dtype: auto follows the checkpoint

# Compute capabilities (major * 10 + minor, inclusive) that 1.0's hardware support matrix
# (docs/source/features/quantization.md) lists for each: FP8 GEMMs need Ada or later; its
# W4A16 AWQ column has Ampere, Ada and Hopper, not Blackwell; FP8 KV cache from Ampere on.
GPU_RANGES = {
    "FP8": (89, 999, "Ada (sm89), Hopper (sm90) or Blackwell (sm100/sm120)"),
    "W4A16_AWQ": (80, 90, "Ampere (sm80/sm86), Ada (sm89) or Hopper (sm90)"),
    "kv:FP8": (80, 999, "Ampere (sm80) or later"),
}


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint directory says of its own quantization."""

    quant_algo: str | None  # weights; None: not quantized
    kv_cache_quant_algo: str | None  # the checkpoint's KV cache quantization (FP8, NVFP4)
    source: str  # the file that said so

    def describe(self) -> str:
        if self.quant_algo is None:
            return "not quantized"
        kv = f", KV cache {self.kv_cache_quant_algo}" if self.kv_cache_quant_algo else ""
        return f"quantized {self.quant_algo}{kv} ({self.source})"


def _json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def read_checkpoint(ckpt: Path) -> CheckpointQuant:
    """The checkpoint's quantization as 1.0's PyTorch backend reads it (hf_quant_config.json
    first, then config.json's quantization_config); a form it cannot load is refused here."""
    modelopt = ckpt / "hf_quant_config.json"
    if modelopt.is_file():
        quant = _json(modelopt).get("quantization")
        if not isinstance(quant, dict) or not quant.get("quant_algo"):
            raise ConfigError(
                f"{modelopt} names no quantization.quant_algo: TensorRT-LLM refuses such a "
                "checkpoint ('Pre-quantized checkpoint must have quant_algo')"
            )
        algo = str(quant["quant_algo"])  # fp8_pb_wo: ModelOpt's name for block-scaled FP8
        algo = "FP8_BLOCK_SCALES" if algo == "fp8_pb_wo" else algo
        kv = quant.get("kv_cache_quant_algo")
        return CheckpointQuant(algo, str(kv) if kv else None, modelopt.name)
    config = ckpt / "config.json"
    inline = _json(config).get("quantization_config") if config.is_file() else None
    if not isinstance(inline, dict):
        return CheckpointQuant(None, None, config.name)
    method = inline.get("quant_method")
    if method == "fp8" and inline.get("weight_block_size"):
        return CheckpointQuant("FP8_BLOCK_SCALES", None, "config.json quantization_config")
    if method == "mxfp4":
        return CheckpointQuant("MXFP4", None, "config.json quantization_config")
    raise ConfigError(
        f"{config}: quantization_config with quant_method {method!r}, which TensorRT-LLM "
        "1.0's PyTorch backend does not load (it reads ModelOpt's hf_quant_config.json, and "
        "of config.json only block-scaled FP8 and MXFP4: NotImplementedError otherwise); "
        "quantize the unquantized model with NVIDIA ModelOpt instead (docs/gpu.md)"
    )


def make_with_modelopt(ckpt: Path, quantization: str, kv_cache_dtype: str) -> str:
    """The ModelOpt command that writes a checkpoint of `quantization` from an unquantized one."""
    kv = "fp8" if kv_cache_dtype == "fp8" else "none"
    return (
        "python TensorRT-Model-Optimizer/examples/llm_ptq/hf_ptq.py "
        f"--pyt_ckpt_path {ckpt} --qformat {SCHEMES[quantization].qformat} "
        f"--kv_cache_qformat {kv} --export_path {ckpt}-{quantization.replace('_', '-')}"
    )


def check_checkpoint(
    found: CheckpointQuant, quantization: str, kv_cache_dtype: str, ckpt: Path
) -> None:
    """Refuse a checkpoint that does not hold what was asked (`auto`: anything it can load)."""
    if quantization != "auto":
        wanted = SCHEMES[quantization].quant_algo
        if found.quant_algo != wanted:
            raise ConfigError(_mismatch(found, quantization, kv_cache_dtype, ckpt))
    if kv_cache_dtype == "fp8" and found.kv_cache_quant_algo not in (None, "FP8"):
        raise ConfigError(
            f"--kv-cache-dtype fp8: {ckpt} stores its KV cache as "
            f"{found.kv_cache_quant_algo} ({found.source}), and TensorRT-LLM refuses to "
            "override a checkpoint's KV cache quantization with another; use "
            "--kv-cache-dtype auto"
        )


def _mismatch(found: CheckpointQuant, quantization: str, kv_cache_dtype: str, ckpt: Path) -> str:
    asked = f"--quantization {quantization}: {ckpt} is {found.describe()}"
    if quantization == "none":
        return (
            f"{asked}, and TensorRT-LLM loads it quantized whatever the options say: "
            "pass --quantization auto (or the matching one), or an unquantized checkpoint"
        )
    wanted = SCHEMES[quantization].quant_algo
    base = f"the unquantized model (not {ckpt})" if found.quant_algo else str(ckpt)
    return (
        f"{asked}, not {wanted}. TensorRT-LLM 1.0's PyTorch backend loads weights as the "
        "checkpoint stores them and quantizes nothing itself (LLM(quant_config=...) is the "
        f"TensorRT-engine backend's); make a {wanted} checkpoint from {base} with NVIDIA "
        "ModelOpt and build from its export path: "
        f"{make_with_modelopt(ckpt, quantization, kv_cache_dtype)} (docs/gpu.md)"
    )


def gpu_requirements(found: CheckpointQuant, kv_cache_dtype: str) -> list[str]:
    """The GPU_RANGES keys that apply: the weights' algorithm and an FP8 KV cache."""
    algo = found.quant_algo
    keys = [algo] if algo is not None and algo in GPU_RANGES else []
    if kv_cache_dtype == "fp8" or found.kv_cache_quant_algo == "FP8":
        keys.append("kv:FP8")
    return keys


def check_gpus(
    requirements: list[str], devices: dict[str, tuple[int, ...]], caps: list[tuple[int, int]]
) -> None:
    """Refuse a pool whose GPUs 1.0's support matrix does not list for what it will run."""
    for key in requirements:
        low, high, which = GPU_RANGES[key]
        for role, ids in devices.items():
            bad = {i: caps[i] for i in ids if i < len(caps) and not low <= _sm(caps[i]) <= high}
            if bad:
                what = "an FP8 KV cache" if key == "kv:FP8" else f"{key} weights"
                gpu, (major, minor) = next(iter(bad.items()))
                raise ConfigError(
                    f"the {role} pool's GPU {gpu} is sm{major}{minor}, and TensorRT-LLM 1.0 "
                    f"runs {what} on {which} only: choose other --{role}-devices or another "
                    "quantization (building for another machine: --num-gpus skips this check)"
                )


def _sm(cap: tuple[int, int]) -> int:
    return cap[0] * 10 + cap[1]
