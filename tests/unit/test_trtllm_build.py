"""The TensorRT-LLM build plan and the GPU serving configuration, without a GPU: dry runs,
the files a PyTorch-backend build writes, and the GPU variant of every model config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from disagg.serve.render import render_repositories
from disagg.settings import ModelParams, ServeSettings, template_values

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "build_engines" / "build_trtllm_engine.py"


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


def test_dry_run_of_the_legacy_build_prints_every_command_and_writes_nothing(tmp_path):
    out = tmp_path / "engines"
    r = run("--checkpoint", "/models/llama", "--out", str(out), "--backend", "tensorrt",
            "--prefill-tp", "2", "--decode-tp", "4", "--dry-run")  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    converts = [x for x in lines if "convert_checkpoint.py" in x]
    builds = [x for x in lines if x.startswith("trtllm-build ")]
    assert len(converts) == 2 and len(builds) == 2
    assert "--tp_size 2" in converts[0] and "--tp_size 4" in converts[1]
    assert f"--output_dir {out}/prefill_engine" in builds[0]
    assert f"--output_dir {out}/decode_engine" in builds[1]
    assert "--max_batch_size 8 " in builds[0] and "--max_batch_size 128 " in builds[1]
    assert f"# write {out}/serve.toml:" in r.stdout
    assert not out.exists()


def test_pytorch_backend_build_writes_pool_options_and_settings_that_serve_loads(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = tmp_path / "engines"
    r = run("--checkpoint", str(ckpt), "--out", str(out), "--transceiver", "NIXL",
            "--decode-max-batch-size", "64", "--decode-tp", "2")  # fmt: skip
    assert r.returncode == 0, r.stderr
    prefill = yaml.safe_load((out / "prefill.yaml").read_text())
    decode = yaml.safe_load((out / "decode.yaml").read_text())
    assert (
        prefill["disable_overlap_scheduler"] is True and "disable_overlap_scheduler" not in decode
    )
    assert decode["cache_transceiver_config"]["backend"] == "NIXL"
    assert decode["max_batch_size"] == 64 and decode["tensor_parallel_size"] == 2
    settings = ServeSettings.load(out / "serve.toml", env={})
    assert settings.engine_backend == "tensorrt_llm" and settings.instance_kind == "KIND_GPU"
    assert settings.trtllm_decode_model == str(ckpt) and settings.decode_max_num_seqs == 64


def test_legacy_build_without_tensorrt_llm_fails_clearly(tmp_path):
    r = run("--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"), "--backend", "tensorrt")
    assert r.returncode == 2 and "trtllm-build not found" in r.stderr


def test_gpu_variant_of_every_model_config_parses(tmp_path):
    settings = ServeSettings(
        engine_backend="tensorrt_llm",
        instance_kind="KIND_GPU",
        trtllm_prefill_model="/engines/prefill_engine",
        trtllm_decode_model="/engines/decode_engine",
        trtllm_prefill_options="/engines/prefill.yaml",
        trtllm_decode_options="/engines/decode.yaml",
    )
    repos = render_repositories(template_values(settings, tmp_path / "run"), tmp_path / "out")
    configs = {
        cfg.parent.name: text_format.Parse(cfg.read_text(), model_config_pb2.ModelConfig())
        for repo in repos
        for cfg in repo.glob("*/config.pbtxt")
    }
    for role in ("prefill", "decode"):
        c = configs[role]
        assert c.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
        assert c.parameters["engine_backend"].string_value == "tensorrt_llm"
        assert c.parameters[f"trtllm_{role}_model"].string_value == f"/engines/{role}_engine"
        assert c.parameters[f"trtllm_{role}_options"].string_value == f"/engines/{role}.yaml"
    assert len(configs) == 9


def test_runtime_builds_each_pool_with_its_options(tmp_path, monkeypatch):
    """The LLM gets the pool's options file as keyword arguments (test double of the library,
    see tests/fakes/tensorrt_llm)."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "fakes"))
    for name in [m for m in sys.modules if m.startswith("tensorrt_llm")]:
        monkeypatch.delitem(sys.modules, name)
    from disagg.trtllm.runtime import decode_engine, prefill_engine

    (tmp_path / "p.yaml").write_text(
        "max_batch_size: 8\nkv_cache_config: {free_gpu_memory_fraction: 0.5}\n"
    )
    options = str(tmp_path / "p.yaml")
    p = ModelParams(
        {
            "trtllm_prefill_model": "/ckpt",
            "trtllm_prefill_options": options,
            "trtllm_decode_model": "/ckpt",
            "trtllm_decode_options": options,
            "max_model_len": "512",
            "decode_max_num_seqs": "3",
        }
    )
    pre = prefill_engine(p)
    assert pre.llm.model == "/ckpt" and pre.llm.options["kv_cache_config"] == {
        "free_gpu_memory_fraction": 0.5
    }  # noqa: E501
    assert pre.max_prompt_tokens == 511 and decode_engine(p).max_num_seqs == 3
