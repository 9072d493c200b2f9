"""Test double of `tensorrt_llm.llmapi.llm_utils.update_llm_args_with_extra_dict`: what
upstream's Triton model and trtllm-serve pass YAML options through. In 1.0 (llm_args.py) it
builds these nested configs from their dicts and leaves the rest, kv_cache_config and
cache_transceiver_config included, to TorchLlmArgs' pydantic validation. (quant_config is
built too, and then refused by TorchLlmArgs, which has no such field: a private attribute.)

And of what 1.0's PyTorch path reads of a checkpoint's quantization before loading it
(`update_from_hf_quant_config`, upstream ModelLoader._update_from_hf_quant_config)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

BUILT = ("quant_config", "calib_config", "build_config", "decoding_config",
         "enable_build_cache", "speculative_config", "lora_config", "moe_config")  # fmt: skip
# 1.0's QuantAlgo values (tensorrt_llm/quantization/mode.py), as hf_quant_config.json spells them
QUANT_ALGOS = frozenset(
    [
        "W8A16",
        "W4A16",
        "W4A16_AWQ",
        "W4A8_AWQ",
        "W8A16_GPTQ",
        "W4A16_GPTQ",
        "W8A8_SQ_PER_CHANNEL",
        "W8A8_SQ_PER_TENSOR_PLUGIN",
        "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
        "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
        "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
        "W4A8_QSERVE_PER_GROUP",
        "W4A8_QSERVE_PER_CHANNEL",
        "FP8",
        "FP8_PER_CHANNEL_PER_TOKEN",
        "FP8_BLOCK_SCALES",
        "INT8",
        "MIXED_PRECISION",
        "NVFP4",
        "W4A8_NVFP4_FP8",
        "W4A8_MXFP4_FP8",
        "W4A8_MXFP4_MXFP8",
        "W4A16_MXFP4",
        "NO_QUANT",
    ]
)


def update_llm_args_with_extra_dict(llm_args: dict, llm_args_dict: dict, extra=None) -> dict:
    for name in BUILT:
        if name in llm_args_dict:
            if not isinstance(llm_args_dict[name], dict):
                raise TypeError(f"{name}: a mapping, got {type(llm_args_dict[name]).__name__}")
            llm_args_dict[name] = SimpleNamespace(**llm_args_dict[name])
    return llm_args | llm_args_dict


def update_from_hf_quant_config(model_dir: str, kv_cache_dtype: str) -> None:
    """ModelOpt's hf_quant_config.json first: it must name a QuantAlgo, and a KV cache
    algorithm of its own must agree with kv_cache_config.dtype (fp8 sets FP8 through
    TorchLlmArgs.sync_quant_config_with_kv_cache_config_dtype); else config.json's
    quantization_config, of which only block-scaled FP8 and MXFP4 load. A model that is
    not a local directory (a hub name, a test's "/ckpt") is not read."""
    path = Path(model_dir)
    modelopt, config = path / "hf_quant_config.json", path / "config.json"
    asked_kv = "FP8" if kv_cache_dtype == "fp8" else None
    if modelopt.is_file():
        quant = json.loads(modelopt.read_text())["quantization"]
        algo, kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
        if algo is None:
            raise ValueError("Pre-quantized checkpoint must have quant_algo.")
        for value in (algo, kv):
            if value is not None and value != "fp8_pb_wo" and value not in QUANT_ALGOS:
                raise ValueError(f"'{value}' is not a valid QuantAlgo")
        if kv is not None and asked_kv is not None and kv != asked_kv:
            raise ValueError(
                f"Specified kv_cache_quant_algo={asked_kv}, conflicting with "
                f"kv_cache_quant_algo={kv} from HF quant config."
            )
        return
    inline = None
    if config.is_file():
        inline = json.loads(config.read_text()).get("quantization_config")
    if inline is None:
        return
    method = inline.get("quant_method")
    if not (method == "fp8" and inline.get("weight_block_size")) and method != "mxfp4":
        raise NotImplementedError(f"Unsupported quantization_config: {inline}.")
