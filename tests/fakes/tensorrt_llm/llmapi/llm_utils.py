"""Test double of `tensorrt_llm.llmapi.llm_utils.update_llm_args_with_extra_dict`: what
upstream's Triton model and trtllm-serve pass YAML options through. In 1.0 (llm_args.py) it
builds these nested configs from their dicts and leaves the rest, kv_cache_config and
cache_transceiver_config included, to TorchLlmArgs' pydantic validation."""

from __future__ import annotations

from types import SimpleNamespace

BUILT = ("quant_config", "calib_config", "build_config", "decoding_config",
         "enable_build_cache", "speculative_config", "lora_config", "moe_config")  # fmt: skip


def update_llm_args_with_extra_dict(llm_args: dict, llm_args_dict: dict, extra=None) -> dict:
    for name in BUILT:
        if name in llm_args_dict:
            if not isinstance(llm_args_dict[name], dict):
                raise TypeError(f"{name}: a mapping, got {type(llm_args_dict[name]).__name__}")
            llm_args_dict[name] = SimpleNamespace(**llm_args_dict[name])
    return llm_args | llm_args_dict
