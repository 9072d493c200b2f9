"""The argument set of TensorRT-LLM 1.0's LLM API (tensorrt_llm/llmapi/llm_args.py), as data:
field names only, from BaseLlmArgs + TorchLlmArgs and the nested configs disagg writes. The
real classes are pydantic models with extra="forbid": an unknown key fails `LLM()`. The
double checks the same (see ../__init__.py)."""

from __future__ import annotations

from typing import Literal


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


BASE_FIELDS = _names(
    """model tokenizer tokenizer_mode skip_tokenizer_init trust_remote_code
    tensor_parallel_size dtype revision tokenizer_revision pipeline_parallel_size
    context_parallel_size gpus_per_node moe_cluster_parallel_size moe_tensor_parallel_size
    moe_expert_parallel_size enable_attention_dp cp_config load_format
    fail_fast_on_attention_window_too_large enable_lora lora_config kv_cache_config
    enable_chunked_prefill guided_decoding_backend batched_logits_processor
    iter_stats_max_iterations request_stats_max_iterations peft_cache_config scheduler_config
    cache_transceiver_config speculative_config max_batch_size max_input_len max_seq_len
    max_beam_width max_num_tokens gather_generation_logits num_postprocess_workers
    postprocess_tokenizer_dir reasoning_parser decoding_config mpi_session backend"""
)
TORCH_FIELDS = BASE_FIELDS | _names(
    """build_config garbage_collection_gen0_threshold cuda_graph_config
    disable_overlap_scheduler moe_config attn_backend enable_mixed_sampler
    enable_trtllm_sampler enable_iter_perf_stats enable_iter_req_stats print_iter_log
    torch_compile_config enable_autotuner enable_layerwise_nvtx_marker enable_min_latency
    stream_interval force_dynamic_quantization allreduce_strategy checkpoint_loader
    checkpoint_format connector_config"""
)
KV_CACHE_FIELDS = _names(
    """enable_block_reuse max_tokens max_attention_window sink_token_length
    free_gpu_memory_fraction host_cache_size onboard_blocks cross_kv_cache_fraction
    secondary_offload_min_priority event_buffer_max_size enable_partial_reuse
    copy_on_partial_reuse use_uvm dtype"""
)
TRANSCEIVER_FIELDS = frozenset({"backend", "max_tokens_in_buffer"})
# KvCacheConfig.dtype is a free str in 1.0, checked when the model loads against
# _VALID_KV_CACHE_DTYPES (_torch/pyexecutor/model_loader.py; nvfp4 needs a checkpoint with it)
KV_CACHE_DTYPES = ("fp8", "nvfp4", "auto")


class _Field:
    def __init__(self, annotation) -> None:
        self.annotation = annotation


class CacheTransceiverConfig:
    """Only what disagg reads: the `backend` field's annotation, a Literal whose case changed
    between releases (1.0: lowercase; later: uppercase). Tests swap it."""

    model_fields = {"backend": _Field(Literal["default", "ucx", "nixl", "mpi"] | None)}
