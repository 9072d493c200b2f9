"""The TensorRT-LLM deployment plan and the GPU serving configuration, without a GPU: dry runs,
the files a build writes (checked against the LLM-API argument set of the test double, which
holds upstream 1.0's field names), and the GPU variant of every model config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from disagg.engine.config import ENGINE_FORMAT_VERSION
from disagg.engine.tokenizer import Tokenizer
from disagg.model_params import ModelParams
from disagg.serve.render import render_repositories
from disagg.settings import ServeSettings, template_values

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "build_engines" / "build_trtllm_engine.py"
FAKES = ROOT / "tests" / "fakes"


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def checkpoint(tmp_path, engine_dir):
    """A Llama-3.1-shaped Hugging Face checkpoint directory (config + tokenizer, no weights:
    TensorRT-LLM would read those), with rope scaling the CPU engine cannot run."""
    ckpt = tmp_path / "checkpoints" / "llama"
    ckpt.mkdir(parents=True)
    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }  # fmt: skip
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "tokenizer.json").write_text((Path(engine_dir) / "tokenizer.json").read_text())
    tok = json.loads((Path(engine_dir) / "tokenizer_config.json").read_text())
    tok["eos_token"] = {"content": tok["eos_token"]}  # HF writes special tokens either way
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok))
    return ckpt


@pytest.fixture
def trt(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES))
    for name in [m for m in sys.modules if m.startswith("tensorrt_llm")]:
        monkeypatch.delitem(sys.modules, name)
    import tensorrt_llm

    return tensorrt_llm


def test_dry_run_prints_every_file_and_writes_nothing(tmp_path):
    out = tmp_path / "engines"
    r = run("--checkpoint", "/models/llama", "--out", str(out), "--prefill-tp", "2",
            "--prefill-devices", "0,1", "--decode-devices", "2", "--dry-run")  # fmt: skip
    assert r.returncode == 0, r.stderr
    for name in ("prefill.yaml", "decode.yaml", "serve.toml"):
        assert f"# write {out}/{name}:" in r.stdout
    assert f"# write {out}/disagg/: config.json and tokenizer files" in r.stdout
    assert "tensor_parallel_size: 2" in r.stdout
    assert "note: /models/llama is outside the checkout" in r.stdout  # compose won't see it
    assert not out.exists()


def test_a_build_writes_options_the_llm_api_accepts_and_settings_serve_loads(
    tmp_path, checkpoint, trt
):
    out = tmp_path / "engines" / "llama"
    r = run("--checkpoint", str(checkpoint), "--out", str(out), "--transceiver", "nixl",
            "--decode-max-batch-size", "64", "--decode-tp", "2", "--decode-devices", "1,2",
            "--decode-host-cache-gb", "4")  # fmt: skip
    assert r.returncode == 0, r.stderr
    prefill = yaml.safe_load((out / "prefill.yaml").read_text())
    decode = yaml.safe_load((out / "decode.yaml").read_text())
    from disagg.trtllm.runtime import spell_transceiver, transceiver_backends

    for options in (prefill, decode):  # no key outside upstream's argument set
        trt.LLM("ckpt", **spell_transceiver(options, transceiver_backends()))
    assert prefill["disable_overlap_scheduler"] is True
    assert "disable_overlap_scheduler" not in decode
    assert decode["cache_transceiver_config"]["backend"] == "NIXL"
    assert decode["max_batch_size"] == 64 and decode["tensor_parallel_size"] == 2
    # decode prefills fallback prompts itself: over its token budget only in chunks
    assert decode["max_num_tokens"] < decode["max_seq_len"] and decode["enable_chunked_prefill"]
    assert "enable_chunked_prefill" not in prefill  # 8192 >= 4096: whole prompts fit
    assert decode["kv_cache_config"] == {
        "free_gpu_memory_fraction": 0.85,
        "enable_block_reuse": True,  # prefix caching on both pools, with events for a router
        "event_buffer_max_size": 1024,
        "host_cache_size": 4 << 30,  # KV offload to host memory, asked for
    }
    assert prefill["kv_cache_config"]["enable_block_reuse"] is True
    settings = ServeSettings.load(out / "serve.toml", env={})
    assert settings.engine_backend == "tensorrt_llm"
    assert settings.trtllm_decode_model == str(checkpoint) and settings.decode_max_num_seqs == 64
    assert (settings.trtllm_prefill_devices, settings.trtllm_decode_devices) == ("0", "1,2")
    assert settings.conditional_remote_stall == 0.0  # separate GPUs
    # the engine directory: what the tokenizer, router and orchestrator load
    assert settings.path("engine_dir") == out / "disagg"
    tok = Tokenizer(settings.path("engine_dir"))
    assert tok.eos_token_id is not None and tok.encode("Hello") != []
    meta = json.loads((out / "disagg" / "config.json").read_text())
    assert meta["format_version"] == ENGINE_FORMAT_VERSION and meta["n_kv_heads"] == 2
    assert not (out / "disagg" / "model.safetensors").exists()


def test_pools_sharing_a_gpu_get_fractions_that_fit_together(tmp_path, checkpoint):
    out = tmp_path / "o"
    r = run("--checkpoint", str(checkpoint), "--out", str(out), "--decode-devices", "0")
    assert r.returncode == 0, r.stderr
    fractions = [
        yaml.safe_load((out / f"{role}.yaml").read_text())["kv_cache_config"][
            "free_gpu_memory_fraction"
        ]
        for role in ("prefill", "decode")
    ]
    assert sum(fractions) < 0.9  # each takes a share of the free memory it finds at load
    assert ServeSettings.load(out / "serve.toml", env={}).conditional_remote_stall == 0.5
    r = run("--checkpoint", str(checkpoint), "--out", str(out), "--decode-devices", "0",
            "--prefill-kv-fraction", "0.5", "--decode-kv-fraction", "0.5")  # fmt: skip
    assert r.returncode == 2 and "sum under 0.95" in r.stderr
    r = run("--checkpoint", str(checkpoint), "--out", str(out), "--decode-tp", "2",
            "--decode-devices", "1")  # fmt: skip
    assert r.returncode == 2 and "2 GPU(s)" in r.stderr


def test_a_checkpoint_that_is_not_one_fails_clearly(tmp_path):
    r = run("--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "not a Hugging Face checkpoint" in r.stderr


def test_serve_toml_paths_inside_the_checkout_are_relative(tmp_path):
    """So the file works on the host and in the compose gpu service (checkout at /opt/disagg)."""
    from disagg.trtllm.build import BuildSpec, serve_settings

    spec = BuildSpec(checkpoint=ROOT / "checkpoints" / "m", out_dir=ROOT / "engines" / "m")
    s = serve_settings(spec)
    assert s["trtllm_prefill_model"] == "checkpoints/m"
    assert s["trtllm_decode_options"] == "engines/m/decode.yaml"
    assert s["engine_dir"] == "engines/m/disagg"


def test_gpu_variant_of_every_model_config_parses_and_resolves_paths(tmp_path):
    settings = ServeSettings(
        engine_backend="tensorrt_llm",
        trtllm_prefill_model="checkpoints/llama",  # not here: stays as given (a hub name)
        trtllm_decode_model=str(ROOT / "model_repository"),  # exists: absolute
        trtllm_prefill_options="engines/x/prefill.yaml",
        trtllm_decode_options="/abs/decode.yaml",
        trtllm_prefill_devices="0",
        trtllm_decode_devices="1",
    )
    repos = render_repositories(template_values(settings, tmp_path / "run"), tmp_path / "out")
    configs = {
        cfg.parent.name: text_format.Parse(cfg.read_text(), model_config_pb2.ModelConfig())
        for repo in repos
        for cfg in repo.glob("*/config.pbtxt")
    }
    for role, device in (("prefill", "0"), ("decode", "1")):
        c = configs[role]
        # the model picks its GPUs itself (upstream's LLM-API model does the same)
        assert c.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
        assert c.parameters["engine_backend"].string_value == "tensorrt_llm"
        assert c.parameters[f"trtllm_{role}_devices"].string_value == device
        ModelParams({k: v.string_value for k, v in c.parameters.items()}, role)
    p = configs["prefill"].parameters
    assert p["trtllm_prefill_options"].string_value == str(ROOT / "engines/x/prefill.yaml")
    assert p["trtllm_prefill_model"].string_value == "checkpoints/llama"
    d = configs["decode"].parameters
    assert d["trtllm_decode_options"].string_value == "/abs/decode.yaml"
    assert d["trtllm_decode_model"].string_value == str(ROOT / "model_repository")
    assert len(configs) == 9


def test_tensorrt_llm_pools_are_one_process_each():
    with pytest.raises(Exception, match="one process"):
        ServeSettings(engine_backend="tensorrt_llm", decode_instances=2)


def test_kv_reuse_can_be_turned_off(tmp_path, checkpoint, trt):
    out = tmp_path / "o"
    r = run("--checkpoint", str(checkpoint), "--out", str(out), "--no-kv-reuse")
    assert r.returncode == 0, r.stderr
    for role in ("prefill", "decode"):
        options = yaml.safe_load((out / f"{role}.yaml").read_text())
        kv = options["kv_cache_config"]
        assert kv["enable_block_reuse"] is False and kv["event_buffer_max_size"] == 0
        trt.LLM("ckpt", **{k: v for k, v in options.items() if k != "cache_transceiver_config"})


def _fake_nvidia_smi(tmp_path, num_gpus: int) -> dict:
    """An environment whose nvidia-smi lists `num_gpus` GPUs, as the real one does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo {i}\n" for i in range(num_gpus)))
    smi.chmod(0o755)
    import os

    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_the_build_counts_the_gpus_and_refuses_ones_the_machine_lacks(tmp_path, checkpoint):
    """The documented build on a one-GPU machine wrote decode on GPU 1: its process saw no
    GPU and the server exited. Now the defaults follow the count, and a list naming a GPU
    that is not there fails the build with the fix."""
    out = tmp_path / "o"
    env = _fake_nvidia_smi(tmp_path, 1)
    args = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--out", str(out)]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "# GPUs: 1 on the serving machine" in r.stdout
    s = ServeSettings.load(out / "serve.toml", env={})
    assert (s.trtllm_prefill_devices, s.trtllm_decode_devices) == ("0", "0")  # shared
    assert s.conditional_remote_stall == 0.5
    r = subprocess.run([*args, "--decode-devices", "1"], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "names GPU(s) [1], but this machine has 1" in r.stderr
    r = run("--checkpoint", str(checkpoint), "--out", str(out), "--num-gpus", "2")
    assert r.returncode == 0, r.stderr
    assert ServeSettings.load(out / "serve.toml", env={}).trtllm_decode_devices == "1"
    r = run("--checkpoint", str(checkpoint), "--out", str(out), "--num-gpus", "2",
            "--decode-tp", "2")  # fmt: skip
    assert r.returncode == 0, r.stderr  # 1 + 2 > 2: decode shares GPUs 0-1 with prefill
    assert ServeSettings.load(out / "serve.toml", env={}).trtllm_decode_devices == "0,1"


def test_serve_refuses_pool_gpus_the_machine_lacks_before_starting_triton(
    tmp_path, engine_dir, monkeypatch
):
    from disagg.errors import ConfigError
    from disagg.serve.server import TritonServer, check_pool_gpus
    from disagg.trtllm import gpus

    s = ServeSettings(engine_backend="tensorrt_llm", engine_dir=str(engine_dir),
                      trtllm_prefill_devices="0", trtllm_decode_devices="1",
                      build_dir=str(tmp_path / "build"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"trtllm_decode_devices names GPU\(s\) \[1\]"):
        check_pool_gpus(s, count=lambda: 1)
    check_pool_gpus(s, count=lambda: 2)
    with pytest.raises(ConfigError, match="no NVIDIA GPU can be counted"):
        check_pool_gpus(s, count=lambda: None)
    remote = ServeSettings(engine_backend="tensorrt_llm", role="frontend",
                           prefill_replicas="a:1", decode_replicas="b:1",
                           trtllm_decode_devices="7")  # fmt: skip
    check_pool_gpus(remote, count=lambda: None)  # its pools run elsewhere
    monkeypatch.setattr(gpus, "count_gpus", lambda: 1)
    with pytest.raises(ConfigError, match="rebuild with build_engines"):
        TritonServer(s).start()  # before any tritonserver process
    assert s.startup_budget_s == 1200 and remote.startup_budget_s == 180
    assert ServeSettings().startup_budget_s == 180
    assert ServeSettings(startup_timeout_s=42).startup_budget_s == 42


def _params(tmp_path, options: dict, **extra) -> ModelParams:
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(options))
    raw = {
        "trtllm_prefill_model": "/ckpt",
        "trtllm_prefill_options": str(tmp_path / "p.yaml"),
        "trtllm_decode_model": "/ckpt",
        "trtllm_decode_options": str(tmp_path / "p.yaml"),
        "trtllm_prefill_devices": "",
        "trtllm_decode_devices": "",
        "max_model_len": "512",
        "decode_max_num_seqs": "3",
        "kv_lease_s": "30",
    }
    return ModelParams({**raw, **extra})


@pytest.fixture(autouse=True)
def four_gpus(monkeypatch):
    """The pools' processes count the GPUs before loading: four, unless a test says."""
    from disagg.trtllm import gpus

    monkeypatch.setattr(gpus, "count_gpus", lambda: 4)


def test_runtime_builds_each_pool_with_its_options(tmp_path, trt, monkeypatch):
    from disagg.trtllm.runtime import decode_engine, prefill_engine

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    options = {"max_batch_size": 8, "kv_cache_config": {"free_gpu_memory_fraction": 0.5}}
    pre = prefill_engine(_params(tmp_path, options))
    assert pre.llm.model == "/ckpt" and pre.llm.options == options
    assert isinstance(pre.llm.options["kv_cache_config"], dict)  # pydantic's to validate
    assert pre.max_prompt_tokens == 511
    dec = decode_engine(_params(tmp_path, options, trtllm_decode_devices="3"))
    assert dec.max_num_seqs == 3
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"  # set in the stub before the import


@pytest.mark.parametrize(
    "literals, written, passed",
    [
        (("default", "ucx", "nixl", "mpi"), "UCX", "ucx"),  # 1.0
        (("DEFAULT", "UCX", "NIXL", "MPI"), "ucx", "UCX"),  # later releases
    ],
)
def test_the_transceiver_backend_is_spelled_as_the_installed_version_wants(
    tmp_path, trt, monkeypatch, literals, written, passed
):
    from typing import Literal

    from tensorrt_llm.llmapi import llm_args

    from disagg.trtllm.runtime import prefill_engine

    field = llm_args.CacheTransceiverConfig.model_fields["backend"]
    monkeypatch.setattr(field, "annotation", Literal[literals] | None)
    options = {"cache_transceiver_config": {"backend": written}}
    with pytest.raises(ValueError, match="input should be"):
        trt.LLM("ckpt", **options)  # what pydantic does with the wrong case
    llm = prefill_engine(_params(tmp_path, options)).llm
    assert llm.options["cache_transceiver_config"]["backend"] == passed


@pytest.mark.parametrize(
    "options, extra, message",
    [
        ({"no_such_option": 1}, {}, "Extra inputs"),
        ({"kv_cache_config": {"free_gpu_memory_frac": 0.5}}, {}, "extra inputs"),
        ({"max_num_tokens": 256}, {}, "max_num_tokens 256 is under max_model_len 512"),
        ({"tensor_parallel_size": 2}, {"trtllm_prefill_devices": "0"}, "names 1"),
        ({}, {"trtllm_prefill_devices": "gpu0"}, "GPU indexes"),
        ({}, {"trtllm_prefill_devices": "5"}, r"names GPU\(s\) \[5\], but this machine has 4"),
        ({"kv_cache_config": {"enable_block_resue": True}}, {}, "extra inputs"),
        ({"kv_cache_config": {"event_buffer_max_size": "1k"}}, {}, "valid int"),
    ],
)
def test_options_the_library_or_the_pool_cannot_take_fail_at_load(
    tmp_path, trt, options, extra, message
):
    from disagg.trtllm.runtime import prefill_engine

    with pytest.raises(Exception, match=message):
        prefill_engine(_params(tmp_path, options, **extra))


def test_options_go_through_upstreams_extra_dict_and_each_pool_gets_its_own_mpi_world(
    tmp_path, trt, monkeypatch
):
    """Nested configs that need building (here moe_config) are built the way upstream's
    Triton model builds them; an MPI job the server was started in is left behind (its
    ranks' variables would make the pool join it), MPI settings kept."""
    from types import SimpleNamespace

    from disagg.trtllm.runtime import isolate_from_mpi_job, prefill_engine, prepare_process

    options = {"moe_config": {"backend": "CUTLASS"}, "kv_cache_config": {"max_tokens": 64}}
    llm = prefill_engine(_params(tmp_path, options)).llm
    assert isinstance(llm.options["moe_config"], SimpleNamespace)
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "3",
           "PMI_SIZE": "4", "OMPI_MCA_btl": "tcp,self", "PMIX_MCA_gds": "hash",
           "ORTE_HNP_URI": "x", "PATH": "/bin"}  # fmt: skip
    assert isolate_from_mpi_job(dict(env)) == sorted(
        ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "ORTE_HNP_URI"]
    )
    prepare_process("1", env)
    assert env == {"OMPI_MCA_btl": "tcp,self", "PMIX_MCA_gds": "hash", "PATH": "/bin",
                   "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}  # fmt: skip


def test_the_context_transfer_timeout_is_set_where_the_library_has_one(tmp_path, trt, monkeypatch):
    """1.0's CacheTransceiverConfig has backend and max_tokens_in_buffer only (the field
    would be refused there); later releases take kv_transfer_timeout_ms: prefill's contexts
    then free their blocks after disagg's KV lease."""
    from tensorrt_llm.llmapi import llm_args

    from disagg.trtllm.runtime import decode_engine, prefill_engine

    options = {"cache_transceiver_config": {"backend": "UCX"}}
    llm = prefill_engine(_params(tmp_path, options)).llm
    assert "kv_transfer_timeout_ms" not in llm.options["cache_transceiver_config"]  # 1.0
    field = llm_args.CacheTransceiverConfig.model_fields["backend"]
    monkeypatch.setattr(llm_args.CacheTransceiverConfig, "model_fields",
                        {"backend": field, "kv_transfer_timeout_ms": object()})  # fmt: skip
    monkeypatch.setattr(llm_args, "TRANSCEIVER_FIELDS",
                        llm_args.TRANSCEIVER_FIELDS | {"kv_transfer_timeout_ms"})  # fmt: skip
    llm = prefill_engine(_params(tmp_path, options)).llm
    assert llm.options["cache_transceiver_config"]["kv_transfer_timeout_ms"] == 30_000
    llm = decode_engine(_params(tmp_path, options)).llm  # the generation side waits as before
    assert "kv_transfer_timeout_ms" not in llm.options["cache_transceiver_config"]


def _modelopt_export(ckpt: Path, quant_algo: str, kv_cache_quant_algo: str | None = None) -> Path:
    """`ckpt` made into what ModelOpt's hf_ptq.py exports (hf_quant_config.json beside the
    weights), as a checkpoint of `quant_algo` (QuantAlgo's spelling)."""
    quant = {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo,
             "exclude_modules": ["lm_head"]}  # fmt: skip
    if quant_algo == "W4A16_AWQ":
        quant |= {"group_size": 128, "has_zero_point": False, "pre_quant_scale": True}
    config = {"producer": {"name": "modelopt", "version": "0.35.0"}, "quantization": quant}
    (ckpt / "hf_quant_config.json").write_text(json.dumps(config))
    return ckpt


@pytest.mark.parametrize(
    "algo, quantization, kv_dtype",
    [("FP8", "fp8", "fp8"), ("W4A16_AWQ", "int4_awq", "auto"), (None, "none", "fp8")],
)
def test_quantized_builds_reach_llm_with_the_names_1_0_reads(
    tmp_path, checkpoint, trt, algo, quantization, kv_dtype
):
    """The weights' quantization is the checkpoint's (no option carries it: 1.0's TorchLlmArgs
    has no quant_config), checked by the build; the KV cache dtype goes down as
    kv_cache_config.dtype, the same on both pools."""
    if algo:
        _modelopt_export(checkpoint, algo)
    out = tmp_path / "engines" / "q"
    r = run("--checkpoint", str(checkpoint), "--out", str(out), "--num-gpus", "2",
            "--quantization", quantization, "--kv-cache-dtype", kv_dtype)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"# quantization: {quantization}" in r.stdout
    described = f"quantized {algo} (hf_quant_config.json)" if algo else "not quantized"
    assert f"# checkpoint: {described}; not checked against the pools' GPUs" in r.stdout
    assert json.loads((out / "build.json").read_text())["quantization"] == quantization
    from disagg.trtllm.runtime import decode_engine, prefill_engine

    for role, build in (("prefill", prefill_engine), ("decode", decode_engine)):
        options = yaml.safe_load((out / f"{role}.yaml").read_text())
        assert "quant_config" not in options  # TorchLlmArgs would refuse it (the double too)
        if kv_dtype == "auto":
            assert "dtype" not in options["kv_cache_config"]  # upstream's default: auto
        else:
            assert options["kv_cache_config"]["dtype"] == kv_dtype
        llm = build(_params(tmp_path, options, **{f"trtllm_{role}_model": str(checkpoint)})).llm
        assert llm.model == str(checkpoint)  # the double read its hf_quant_config.json
        assert llm.options["kv_cache_config"].get("dtype", "auto") == kv_dtype


def test_a_checkpoint_that_does_not_hold_the_asked_quantization_is_refused(tmp_path, checkpoint):
    def refused(*args: str) -> str:
        r = run("--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"), "--dry-run", *args)
        assert r.returncode == 2, r.stdout
        return r.stderr

    err = refused("--quantization", "fp8")  # an unquantized checkpoint: nothing quantizes it
    assert "is not quantized, not FP8" in err and "quantizes nothing itself" in err
    assert f"hf_ptq.py --pyt_ckpt_path {checkpoint} --qformat fp8" in err
    _modelopt_export(checkpoint, "FP8", "FP8")
    err = refused("--quantization", "int4_awq")
    assert "is quantized FP8, KV cache FP8 (hf_quant_config.json), not W4A16_AWQ" in err
    assert "from the unquantized model" in err and "--qformat int4_awq" in err
    assert "loads it quantized whatever the options say" in refused("--quantization", "none")
    assert "invalid choice: 'int8'" in refused("--quantization", "int8")
    _modelopt_export(checkpoint, "FP8", "NVFP4")
    assert "stores its KV cache as NVFP4" in refused("--kv-cache-dtype", "fp8")
    (checkpoint / "hf_quant_config.json").unlink()
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (checkpoint / "config.json").write_text(json.dumps(config))  # AutoAWQ's form
    assert "quant_method 'awq', which TensorRT-LLM 1.0's PyTorch" in refused()
    r = run("--checkpoint", "/models/llama", "--out", str(tmp_path / "o"), "--dry-run",
            "--quantization", "fp8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "# quantization: not checked, /models/llama is not here" in r.stdout


def test_the_double_refuses_what_1_0_refuses_of_a_quantized_checkpoint(tmp_path, checkpoint, trt):
    """What the build's refusals stand in front of: 1.0 fails these at load."""
    with pytest.raises(ValueError, match="Extra inputs"):
        trt.LLM(str(checkpoint), quant_config={"quant_algo": "FP8"})  # TensorRT backend only
    with pytest.raises(ValueError, match="invalid type"):
        trt.LLM(str(checkpoint), kv_cache_config={"dtype": "int8"})
    _modelopt_export(checkpoint, "FP8", "NVFP4")
    with pytest.raises(ValueError, match="conflicting with kv_cache_quant_algo=NVFP4"):
        trt.LLM(str(checkpoint), kv_cache_config={"dtype": "fp8"})
    trt.LLM(str(checkpoint), kv_cache_config={"dtype": "auto"})
    (checkpoint / "hf_quant_config.json").unlink()
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="Unsupported quantization_config"):
        trt.LLM(str(checkpoint))


def _smi_with_capabilities(tmp_path, caps: list[str]) -> dict:
    """An environment whose nvidia-smi lists len(caps) GPUs and answers compute_cap queries."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    indexes = "".join(f"echo {i}\n" for i in range(len(caps)))
    answers = "".join(f"echo {c}\n" for c in caps)
    smi.write_text(f'#!/bin/sh\ncase "$*" in\n*compute_cap*)\n{answers};;\n*)\n{indexes};;\nesac\n')
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_the_pools_gpus_are_checked_against_what_they_will_run(tmp_path, checkpoint):
    """FP8 needs Ada or later; 1.0's matrix lists W4A16 AWQ for Ampere to Hopper only."""
    args = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint),
            "--out", str(tmp_path / "o"), "--dry-run"]  # fmt: skip

    def build(caps: list[str], *extra: str) -> subprocess.CompletedProcess:
        env = _smi_with_capabilities(tmp_path, caps)
        return subprocess.run([*args, *extra], env=env, capture_output=True, text=True,
                              timeout=60)  # fmt: skip

    r = build(["8.0", "8.0"], "--kv-cache-dtype", "fp8")  # FP8 KV cache: Ampere is fine
    assert r.returncode == 0, r.stderr
    assert "# checkpoint: not quantized; checked against the pools' GPUs" in r.stdout
    _modelopt_export(checkpoint, "FP8")
    r = build(["9.0", "8.0"])  # decode lands on the A100
    assert r.returncode == 2
    assert "the decode pool's GPU 1 is sm80" in r.stderr and "runs FP8 weights on Ada" in r.stderr
    assert build(["9.0", "8.9"]).returncode == 0
    r = build(["8.0", "8.0"], "--num-gpus", "2")  # built for another machine: not checked
    assert r.returncode == 0 and "not checked against the pools' GPUs" in r.stdout
    _modelopt_export(checkpoint, "W4A16_AWQ")
    assert build(["8.6", "9.0"]).returncode == 0
    r = build(["10.0", "10.0"], "--quantization", "int4_awq")
    assert r.returncode == 2 and "GPU 0 is sm100" in r.stderr


def test_gpu_capabilities_come_from_nvidia_smi():
    from disagg.trtllm import gpus

    assert gpus.compute_capabilities(lambda cmd: (0, "9.0\n8.9\n")) == [(9, 0), (8, 9)]
    assert gpus.compute_capabilities(lambda cmd: (0, "0\n1\n")) is None  # not an answer
    assert gpus.compute_capabilities(lambda cmd: (127, "")) is None


def test_build_spec_refuses_an_unknown_quantization():
    from disagg.trtllm.build import BuildSpec

    with pytest.raises(ValueError, match="quantization must be one of"):
        BuildSpec(checkpoint=Path("c"), out_dir=Path("o"), quantization="int8")
    with pytest.raises(ValueError, match="kv cache dtype must be one of"):
        BuildSpec(checkpoint=Path("c"), out_dir=Path("o"), kv_cache_dtype="nvfp4")
