"""Build an engine directory from a checkpoint (GGUF file or Hugging Face Llama directory);
what the directory holds is described in `checkpoint.py`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from disagg.engine.checkpoint import GGUF_TO_HF_LAYER_NAMES, Checkpoint, Progress
from disagg.engine.config import (
    CONFIG_FILE,
    ENGINE_FORMAT_VERSION,
    QUANT_WEIGHTS_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    ModelArgs,
)
from disagg.errors import ConfigError


def read_checkpoint(source: str | Path, max_context: int) -> Checkpoint:
    source = Path(source)
    if source.is_dir():
        from disagg.engine.hf import read_hf_dir

        return read_hf_dir(source, max_context)
    if source.suffix == ".gguf":
        from disagg.engine.gguf import read_gguf

        return read_gguf(source, max_context)
    if not source.exists():
        raise ConfigError(f"checkpoint {source} not found")
    raise ConfigError(f"{source}: expected a .gguf file or a Hugging Face checkpoint directory")


def engine_is_current(engine_dir: str | Path, source: dict[str, Any], max_context: int) -> bool:
    cfg = Path(engine_dir) / CONFIG_FILE
    if not cfg.is_file() or not (Path(engine_dir) / WEIGHTS_FILE).is_file():
        return False
    data: dict[str, Any] = json.loads(cfg.read_text())
    return bool(
        data.get("format_version") == ENGINE_FORMAT_VERSION
        and data.get("source") == source
        and data.get("requested_max_context") == max_context
    )


def _expected_names(args: ModelArgs) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(args.n_layers):
        names |= {f"model.layers.{i}.{n}.weight" for n in GGUF_TO_HF_LAYER_NAMES.values()}
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
    weights: dict[str, npt.NDArray[np.float32]] = {}
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
        if ckpt.blocks is not None:
            _save_blocks(ckpt, tmp / QUANT_WEIGHTS_FILE)
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


def _save_blocks(ckpt: Checkpoint, path: Path) -> None:
    """The checkpoint's quantized tensors as it stores them (engine/quant.py serves them)."""
    from safetensors.numpy import save_file

    assert ckpt.blocks is not None
    arrays: dict[str, npt.NDArray[Any]] = {}
    formats: dict[str, str] = {}
    for b in ckpt.blocks():
        arrays |= {f"{b.name}.qs": b.qs, f"{b.name}.d": b.d, f"{b.name}.m": b.m}
        formats[b.name] = b.fmt
    if arrays:
        save_file(arrays, str(path), metadata={"formats": json.dumps(formats)})


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
