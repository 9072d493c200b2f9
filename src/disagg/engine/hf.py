"""Hugging Face Llama checkpoint directories: read for the CPU engine (read_hf_dir, weights
streamed as float32), or only for the serving metadata of a GPU deployment, where TensorRT-LLM
loads the weights itself (write_serving_metadata)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from disagg.engine.checkpoint import Checkpoint, file_identity
from disagg.engine.config import (
    CONFIG_FILE,
    ENGINE_FORMAT_VERSION,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    ModelArgs,
)
from disagg.errors import ConfigError


def _hf_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{cfg_path} not found: not a Hugging Face checkpoint directory")
    cfg: dict[str, Any] = json.loads(cfg_path.read_text())
    if cfg.get("model_type") != "llama":
        raise ConfigError(f"{path}: model_type {cfg.get('model_type')!r} is not supported")
    return cfg


def _hf_args(cfg: dict[str, Any], path: Path, max_context: int) -> ModelArgs:
    n_heads = cfg["num_attention_heads"]
    if cfg.get("head_dim", cfg["hidden_size"] // n_heads) != cfg["hidden_size"] // n_heads:
        raise ConfigError(f"{path}: head_dim != hidden_size / num_attention_heads")
    return ModelArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads", n_heads),
        hidden_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=cfg.get("rope_theta", 10000.0),
        max_context=min(max_context, cfg.get("max_position_embeddings", max_context)),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
    )


def _hf_tokenizer(path: Path) -> tuple[str, dict[str, Any]]:
    """tokenizer.json's text and our tokenizer config (template and special tokens)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (path / name).is_file():
            raise ConfigError(f"{path / name} not found")
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()

    def special(key: str) -> str | None:
        value = tok_cfg.get(key)
        return value.get("content") if isinstance(value, dict) else value

    return (path / "tokenizer.json").read_text(), {
        "chat_template": template,
        "bos_token": special("bos_token"),
        "eos_token": special("eos_token"),
        "pad_token": special("pad_token"),
        "add_bos_token": bool(tok_cfg.get("add_bos_token", False)),
    }


def read_hf_dir(path: str | Path, max_context: int) -> Checkpoint:
    from safetensors import safe_open

    path = Path(path)
    cfg = _hf_config(path)
    if cfg.get("rope_scaling"):
        raise ConfigError(f"{path}: rope_scaling {cfg['rope_scaling']!r} is not supported")
    args = _hf_args(cfg, path, max_context)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors weights (convert .bin checkpoints first)")
    tokenizer_json, tokenizer_config = _hf_tokenizer(path)
    with_names = []
    for f in files:
        with safe_open(f, framework="numpy") as sf:
            with_names += [(f, k) for k in sf.keys()]  # noqa: SIM118 - safe_open has no __iter__

    def tensors() -> Iterator[tuple[str, npt.NDArray[np.float32]]]:
        import torch

        for f, key in with_names:
            if args.tie_embeddings and key == "lm_head.weight":
                continue
            with safe_open(f, framework="pt") as sf:  # pt: bf16 has no numpy dtype
                yield key, sf.get_tensor(key).to(torch.float32).numpy()

    return Checkpoint(
        args=args,
        num_tensors=len(with_names)
        - int(args.tie_embeddings and any(k == "lm_head.weight" for _, k in with_names)),
        tensors=tensors,
        tokenizer_json=tokenizer_json,
        tokenizer_config=tokenizer_config,
        source={
            "kind": "hf",
            **file_identity(path / "config.json"),
            "files": [f.name for f in files],
        },
    )


def write_serving_metadata(source: str | Path, engine_dir: str | Path, max_context: int) -> Path:
    """The engine directory of a GPU deployment: what the tokenizer, router and orchestrator
    read (config.json with the architecture numbers, the tokenizer files), without weights:
    TensorRT-LLM loads those from the checkpoint itself. The CPU engine's limits (rope
    scaling) do not apply, so Llama 3.x checkpoints are fine here."""
    source, engine_dir = Path(source), Path(engine_dir)
    cfg = _hf_config(source)
    args = _hf_args(cfg, source, max_context)
    tokenizer_json, tokenizer_config = _hf_tokenizer(source)
    engine_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "format_version": ENGINE_FORMAT_VERSION,
        **args.to_json(),
        "requested_max_context": max_context,
        "source": {"kind": "hf-metadata", **file_identity(source / "config.json")},
    }
    (engine_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (engine_dir / TOKENIZER_FILE).write_text(tokenizer_json)
    (engine_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config, indent=2))
    return engine_dir
