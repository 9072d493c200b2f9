"""GGML blocks made by gguf-py's own quantizer, for the block-kernel tests."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from disagg.engine import quant
from disagg.engine.checkpoint import split_blocks

FORMATS = {
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q8_0": GGMLQuantizationType.Q8_0,
}


def blocks(fmt: str, n: int, k: int, seed: int = 0) -> tuple[quant.QuantLinear, torch.Tensor]:
    """A random [n, k] weight quantized by gguf-py, and gguf-py's dequantization of it."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(w, FORMATS[fmt])  # [n, k/32 * block bytes]
    ref = torch.from_numpy(np.asarray(dequantize(raw, FORMATS[fmt]), dtype=np.float32))
    return quant.from_blocks(fmt, *split_blocks(fmt, raw)), ref
