"""Building the TensorRT-LLM engines of the prefill and decode models from their parameters:
`trtllm_<pool>_model` (a Hugging Face checkpoint), `trtllm_<pool>_options` (the LLM-API options
build_engines/build_trtllm_engine.py wrote for that pool: batch sizes, KV cache fraction, cache
transceiver, parallelism) and `trtllm_<pool>_devices` (the GPUs the pool may use).

Each pool's model instance is a KIND_CPU process that picks its GPUs itself, as upstream's
LLM-API Triton model does (triton_backend/all_models/llmapi): CUDA_VISIBLE_DEVICES is set
before tensorrt_llm is first imported in the stub, so the pools never share a device by
accident and TensorRT-LLM's own workers (tensor/pipeline parallel) inherit the choice."""

from __future__ import annotations

import os
import typing
from pathlib import Path

from disagg.errors import ConfigError
from disagg.model_params import TrtllmDecodeParams, TrtllmPrefillParams
from disagg.trtllm.engines import TrtllmApi, TrtllmDecodeEngine, TrtllmPrefillEngine

if typing.TYPE_CHECKING:
    from tensorrt_llm import LLM

Options = dict[str, typing.Any]  # LLM-API options, as YAML gives them


def read_options(options_file: str) -> Options:
    import yaml

    if not options_file:
        return {}
    try:
        options: object = yaml.safe_load(Path(options_file).read_text()) or {}
    except OSError as e:
        raise ConfigError(f"TensorRT-LLM options {options_file}: {e}") from e
    if not isinstance(options, dict):
        raise ConfigError(f"TensorRT-LLM options {options_file}: expected a mapping")
    return options


def transceiver_backends() -> tuple[str, ...]:
    """The cache transceiver backends the installed TensorRT-LLM accepts, in its spelling
    (the Literal of CacheTransceiverConfig.backend: lowercase in 1.0, uppercase later)."""
    from tensorrt_llm.llmapi.llm_args import CacheTransceiverConfig

    annotation = CacheTransceiverConfig.model_fields["backend"].annotation
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return tuple(typing.get_args(arg))
    return ()


def spell_transceiver(options: Options, accepted: tuple[str, ...]) -> Options:
    """`options` with cache_transceiver_config.backend in the case the library accepts."""
    cfg = options.get("cache_transceiver_config")
    if not isinstance(cfg, dict) or cfg.get("backend") is None or not accepted:
        return options
    wanted = str(cfg["backend"])
    match = next((a for a in accepted if a.upper() == wanted.upper()), None)
    if match is None:
        raise ConfigError(f"cache transceiver backend {wanted!r}: this TensorRT-LLM has {accepted}")
    return {**options, "cache_transceiver_config": {**cfg, "backend": match}}


def check_devices(devices: str, options: Options, pool: str) -> None:
    """A pool's parallelism must match the GPUs it is given."""
    if not devices:
        return
    ids = [d.strip() for d in devices.split(",")]
    if not all(d.isdigit() for d in ids) or len(set(ids)) != len(ids):
        raise ConfigError(f"trtllm_{pool}_devices {devices!r}: GPU indexes like 0 or 0,1")
    world = int(options.get("tensor_parallel_size", 1)) * int(
        options.get("pipeline_parallel_size", 1)
    )
    if world != len(ids):
        raise ConfigError(
            f"the {pool} pool runs on {world} GPU(s) (tensor x pipeline parallel) but "
            f"trtllm_{pool}_devices names {len(ids)}: {devices}"
        )


def check_token_budget(options: Options, max_model_len: int, pool: str) -> None:
    """TensorRT-LLM refuses a prompt over max_num_tokens (unless generation-only or chunked
    prefill is on): each pool must fit the longest prompt it may prefill itself."""
    limit = options.get("max_num_tokens")
    if limit and not options.get("enable_chunked_prefill") and int(limit) < max_model_len:
        raise ConfigError(
            f"the {pool} pool's max_num_tokens {limit} is under max_model_len {max_model_len}: "
            "a longer prompt would be refused; raise it or set enable_chunked_prefill"
        )


def load_llm(
    model: str, options_file: str, devices: str, pool: str, max_model_len: int
) -> tuple[LLM, TrtllmApi]:
    if not model:
        raise ConfigError(f"engine_backend tensorrt_llm needs trtllm_{pool}_model (a checkpoint)")
    options = read_options(options_file)
    check_devices(devices, options, pool)
    check_token_budget(options, max_model_len, pool)
    if devices:  # before the first import of tensorrt_llm (and torch.cuda) in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    api = TrtllmApi.load()
    options = spell_transceiver(options, transceiver_backends())
    return api.LLM(model=model, **options), api


def prefill_engine(p: TrtllmPrefillParams) -> TrtllmPrefillEngine:
    llm, api = load_llm(
        p.trtllm_prefill_model,
        p.trtllm_prefill_options,
        p.trtllm_prefill_devices,
        "prefill",
        p.max_model_len,
    )
    return TrtllmPrefillEngine(llm, api, max_prompt_tokens=p.max_model_len - 1)


def decode_engine(p: TrtllmDecodeParams) -> TrtllmDecodeEngine:
    llm, api = load_llm(
        p.trtllm_decode_model,
        p.trtllm_decode_options,
        p.trtllm_decode_devices,
        "decode",
        p.max_model_len,
    )
    return TrtllmDecodeEngine(llm, api, max_num_seqs=p.decode_max_num_seqs)
