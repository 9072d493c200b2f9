"""Building the TensorRT-LLM engines of the prefill and decode models from their parameters:
`trtllm_<pool>_model` (a Hugging Face checkpoint, or engines built by build_engines/) and
`trtllm_<pool>_options` (the LLM-API options build_engines/build_trtllm_engine.py wrote for
that pool: batch sizes, KV cache fraction, cache transceiver, parallelism)."""

from __future__ import annotations

from pathlib import Path

from disagg.errors import ConfigError
from disagg.settings import ModelParams
from disagg.trtllm.engines import TrtllmApi, TrtllmDecodeEngine, TrtllmPrefillEngine


def load_llm(model: str, options_file: str):
    import yaml

    if not model:
        raise ConfigError("engine_backend tensorrt_llm needs trtllm_model (checkpoint or engines)")
    options = {}
    if options_file:
        try:
            options = yaml.safe_load(Path(options_file).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"TensorRT-LLM options {options_file}: {e}") from e
    api = TrtllmApi.load()
    return api.LLM(model=model, **options), api


def prefill_engine(p: ModelParams) -> TrtllmPrefillEngine:
    llm, api = load_llm(p.trtllm_prefill_model, p.get("trtllm_prefill_options", ""))
    return TrtllmPrefillEngine(llm, api, max_prompt_tokens=p.max_model_len - 1)


def decode_engine(p: ModelParams) -> TrtllmDecodeEngine:
    llm, api = load_llm(p.trtllm_decode_model, p.get("trtllm_decode_options", ""))
    return TrtllmDecodeEngine(llm, api, max_num_seqs=p.decode_max_num_seqs)
