"""GGUF checkpoints (llama.cpp's format): architecture, tokenizer and dequantized tensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from disagg.engine.checkpoint import (
    BLOCK_LAYOUTS,
    GGUF_TO_HF_LAYER_NAMES,
    Checkpoint,
    QuantBlocks,
    file_identity,
    split_blocks,
)
from disagg.engine.config import ModelArgs
from disagg.errors import ConfigError

if TYPE_CHECKING:
    from gguf import GGUFReader


def _gguf_to_hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_TO_HF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_TO_HF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ConfigError(f"GGUF tensor {name!r} has no place in a Llama model")


def _unpermute_rope(w: npt.NDArray[np.float32], n_heads: int) -> npt.NDArray[np.float32]:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs) back to HF's halves."""
    # w: [n_heads * head_dim, dim]; rows within a head go (pairs, 2) -> (2, pairs)
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader: GGUFReader, key: str, default: object = None) -> Any:  # str, int, list
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf(path: str | Path, max_context: int) -> Checkpoint:
    import gguf
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"GGUF file {path} not found")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises bare ValueError/struct errors on junk
        raise ConfigError(f"{path} is not a readable GGUF file: {e}") from e
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ConfigError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    if _gguf_field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise ConfigError(f"{path}: RoPE scaling is not supported")
    n_heads = int(_gguf_field(reader, "llama.attention.head_count"))
    n_kv_heads = int(_gguf_field(reader, "llama.attention.head_count_kv", n_heads))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    args = ModelArgs(
        dim=int(_gguf_field(reader, "llama.embedding_length")),
        n_layers=int(_gguf_field(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        hidden_dim=int(_gguf_field(reader, "llama.feed_forward_length")),
        vocab_size=int(_gguf_field(reader, "llama.vocab_size", int(embd.shape[1]))),
        norm_eps=float(_gguf_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        max_context=min(max_context, int(_gguf_field(reader, "llama.context_length"))),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
    )

    def unpermute(name: str, w: npt.NDArray[Any]) -> npt.NDArray[Any]:
        if name.endswith("q_proj.weight"):
            return _unpermute_rope(w, n_heads)
        if name.endswith("k_proj.weight"):
            return _unpermute_rope(w, n_kv_heads)
        return w

    def tensors() -> Iterator[tuple[str, npt.NDArray[np.float32]]]:
        for t in reader.tensors:
            name = _gguf_to_hf_name(t.name)
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            yield name, np.ascontiguousarray(unpermute(name, w))

    def blocks() -> Iterator[QuantBlocks]:
        for t in reader.tensors:
            fmt = t.tensor_type.name.lower()
            if fmt in BLOCK_LAYOUTS:  # rows are permuted whole: blocks stay blocks
                name = _gguf_to_hf_name(t.name)
                yield QuantBlocks(name, fmt, *split_blocks(fmt, unpermute(name, t.data)))

    tok_json, tok_config = _gguf_tokenizer(reader)
    return Checkpoint(
        args=args,
        num_tensors=len(reader.tensors),
        tensors=tensors,
        blocks=blocks,
        tokenizer_json=tok_json,
        tokenizer_config=tok_config,
        source={"kind": "gguf", **file_identity(path)},
    )


# llama.cpp's name for a BPE pre-tokenizer -> whether digits are split one by one first.
_GGUF_PRE_TOKENIZERS = {"smollm": True, "gpt2": False, "default": False, "llama-bpe": False}


def _gguf_tokenizer(reader: GGUFReader) -> tuple[str, dict[str, Any]]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _gguf_field(reader, "tokenizer.ggml.model")
    pre = _gguf_field(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _GGUF_PRE_TOKENIZERS:
        raise ConfigError(f"GGUF tokenizer {kind!r}/{pre!r} is not supported (byte-level BPE)")
    tokens = list(_gguf_field(reader, "tokenizer.ggml.tokens"))
    types = list(_gguf_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ]
    if _GGUF_PRE_TOKENIZERS[pre]:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # token_type 3 = control, 4 = user defined: matched whole, never split by BPE
    specials = [
        AddedToken(t, special=(ty == 3), normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (3, 4)
    ]
    tok.add_tokens(specials)

    def token(key: str) -> str | None:
        idx = _gguf_field(reader, key)
        return None if idx is None else tokens[int(idx)]

    config = {
        "chat_template": _gguf_field(reader, "tokenizer.chat_template"),
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
    }
    return tok.to_str(), config
