"""Model architecture and engine settings: read once, validated, frozen."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from disagg.errors import ConfigError

# what the decode pool's block products multiply (model.Llama.activations; qdot.c for int8,
# qbf16.c for bfloat16)
ACTIVATIONS = ("float32", "int8", "bfloat16")
# as set (the decode_activations setting, LLM's `activations`): "auto" is bfloat16 where the
# blocks are served and the CPU multiplies bf16 natively (AVX512-BF16), else float32
ACTIVATION_SETTINGS = ("auto", *ACTIVATIONS)

# Prompt queries attend in blocks of this many rows, aligned to absolute positions. torch's
# attention rounds a row differently with the rows it is given beside it (its GEMMs pick
# kernels by row count): over 37 cases here, 2 rows of a prompt's tail moved by ~3e-7 when
# computed after a cached prefix instead of with the whole prompt. bf16 activations turn such
# a difference into a whole bf16 step at times (K/V up to 0.06 apart, greedy replies parted).
# Blocks whose rows and keys are fixed by their position make a row's bits the same whole, in
# chunks or after a cached prefix, wherever chunks start and end at multiples of this
# (prefix-cache blocks are 16 tokens; decode's chunks are cut so: aligned_chunk). Computed
# in layers.prompt_attention.
PROMPT_ATTN_ROWS = 16

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
QUANT_WEIGHTS_FILE = "model.q.safetensors"  # the checkpoint's own quantized blocks
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
ENGINE_FORMAT_VERSION = 2  # 2: model.q.safetensors


@dataclass(frozen=True)
class ModelArgs:
    """Architecture numbers of a Llama-family decoder, as stored in an engine's config.json."""

    dim: int  # hidden size
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention when < n_heads)
    hidden_dim: int  # SwiGLU inner size
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_context: int = 2048  # longest prompt + output the engine serves
    tie_embeddings: bool = True
    dtype: str = "float32"
    architecture: str = "llama"
    fingerprint: str = ""  # sha256 of the weights file, written by the build
    head_dim: int = field(init=False)
    n_groups: int = field(init=False)  # query heads sharing one KV head

    def __post_init__(self) -> None:
        if self.architecture != "llama":
            raise ConfigError(f"unsupported architecture {self.architecture!r}; only 'llama'")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"dim {self.dim}, n_heads {self.n_heads}, n_kv_heads {self.n_kv_heads} "
                "do not divide evenly"
            )
        if self.dtype != "float32":
            raise ConfigError(f"unsupported dtype {self.dtype!r}; the CPU engine runs float32")
        object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        object.__setattr__(self, "n_groups", self.n_heads // self.n_kv_heads)

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer, every KV head: [2, L, H_kv, D] fp32
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(data) - known - {"format_version", "source", "requested_max_context"}
        if unknown:
            raise ConfigError(f"unknown model config keys: {sorted(unknown)}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise ConfigError(f"model config incomplete: {e}") from e


def load_model_args(engine_dir: str | Path) -> ModelArgs:
    path = Path(engine_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found: build the engine first (make engine)")
    data = json.loads(path.read_text())
    if data.get("format_version") != ENGINE_FORMAT_VERSION:
        raise ConfigError(
            f"{path}: engine format {data.get('format_version')!r}, expected "
            f"{ENGINE_FORMAT_VERSION}; rebuild the engine"
        )
    return ModelArgs.from_json(data)


@dataclass(frozen=True)
class EngineConfig:
    """Serving limits of one decode engine (one Triton decode instance)."""

    max_num_seqs: int = 32  # sequences decoded together in one batch
    max_model_len: int = 2048  # prompt + output tokens of one sequence
    num_kv_blocks: int = 0  # KV memory budget in blocks; 0: max_num_seqs * max_model_len
    block_size: int = 16  # tokens per KV block (budget granularity)
    max_queue: int = 256  # sequences waiting for admission before new ones are refused
    # prompt tokens decode prefills itself per step, beside the running batch: a longer
    # prompt is prefilled in chunks over several steps, so running sequences keep their pace
    prefill_chunk_tokens: int = 64
    # a burst (more prompts waiting than sequences decoding) is prefilled whole, up to this
    # many prompt tokens a step, so the first prompts' first tokens need not wait for all
    burst_prefill_tokens: int = 2048
    max_tokens_limit: int = 2048  # largest max_tokens a request may ask for
    # Prefix cache: K/V of finished work kept for later prompts that start the same way, in
    # tokens (rounded down to whole blocks); 0 turns it off (engine/prefix_cache.py)
    prefix_cache_tokens: int = 16384
    # Touch the whole KV cache at start: a server pays the page faults (~0.5 ms/MB here)
    # once instead of on the decode steps that first write each page.
    prefault_kv: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.prefault_kv, bool):
            raise ConfigError(f"prefault_kv must be a boolean, got {self.prefault_kv!r}")
        for f in fields(self):
            if f.name == "prefault_kv":
                continue
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{f.name} must be a non-negative integer, got {value!r}")
        if self.prefill_chunk_tokens < 16:
            raise ConfigError("prefill_chunk_tokens must be at least 16")
        if self.burst_prefill_tokens < 16:  # (0 would never prefill a burst: a hang)
            raise ConfigError("burst_prefill_tokens must be at least 16")
        if self.max_num_seqs < 1 or self.max_model_len < 2 or self.block_size < 1:
            raise ConfigError("max_num_seqs >= 1, max_model_len >= 2 and block_size >= 1 required")
        if self.num_kv_blocks == 0:
            blocks = self.max_num_seqs * -(-self.max_model_len // self.block_size)
            object.__setattr__(self, "num_kv_blocks", blocks)

    @property
    def num_prefix_cache_blocks(self) -> int:
        return self.prefix_cache_tokens // self.block_size

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def aligned_chunk(start: int, n: int, prompt_len: int) -> int:
    """A chunk of n tokens from `start` cut back to end where prompt attention's row blocks
    do (PROMPT_ATTN_ROWS), unless it ends the prompt or that would leave it empty:
    its rows then get the bits the whole prompt's would."""
    end = start + n
    cut = end - end % PROMPT_ATTN_ROWS
    return cut - start if end < prompt_len and cut > start else n
