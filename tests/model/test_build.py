"""Engine build: GGUF and Hugging Face sources, idempotence, clear failures."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from disagg.engine.build import build_engine
from disagg.engine.checkpoint import find_packaged_smollm2
from disagg.engine.config import load_model_args
from disagg.errors import ConfigError

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]


def test_gguf_build_is_idempotent_and_complete(engine_dir):
    config = json.loads((engine_dir / "config.json").read_text())
    assert config["source"]["kind"] == "gguf" and len(config["fingerprint"]) == 64
    args = load_model_args(engine_dir)
    assert (args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == (30, 9, 3, 64)
    mtime = (engine_dir / "model.safetensors").stat().st_mtime_ns
    _, built = build_engine(find_packaged_smollm2(), engine_dir)
    assert not built and (engine_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_build_script_reports_missing_source_clearly(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "build_engines" / "build_cpu_engine.py"),
            "--source",
            str(tmp_path / "nope.gguf"),
            "--engine-dir",
            str(tmp_path / "e"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "not found" in r.stderr
    assert not (tmp_path / "e").exists()


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "tiny-gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="architecture 'gpt2' is not supported"):
        build_engine(path, tmp_path / "e")
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
        build_engine(tmp_path / "junk.gguf", tmp_path / "e")


@pytest.fixture(scope="module")
def tiny_hf_checkpoint(tmp_path_factory, engine_dir):
    """A small random Llama saved by transformers, with our tokenizer files beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(d, safe_serialization=True)
    (d / "tokenizer.json").write_text((engine_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((engine_dir / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return d, model


def test_hf_checkpoint_builds_and_matches_transformers(tiny_hf_checkpoint, tmp_path):
    from disagg.engine.model import Llama

    src, ref = tiny_hf_checkpoint
    engine, built = build_engine(src, tmp_path / "engine", max_context=128)
    assert built and load_model_args(engine).max_context == 128
    ids = [5, 17, 300, 42, 7, 9000]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    ours, _, _ = Llama.load(engine).prefill(ids, all_logits=True)
    assert (ours - expected).abs().max().item() < 1e-4


def test_hf_checkpoint_with_unsupported_features_is_refused(tiny_hf_checkpoint, tmp_path):
    import shutil

    src, _ = tiny_hf_checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"type": "yarn"}}))
    with pytest.raises(ConfigError, match="rope_scaling"):
        build_engine(bad, tmp_path / "e")
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral3"}))
    with pytest.raises(ConfigError, match="model_type"):
        build_engine(bad, tmp_path / "e")
