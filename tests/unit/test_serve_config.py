"""Settings and model config templates, without starting a server."""

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from disagg.errors import ConfigError
from disagg.model_params import (
    DecodeParams,
    OrchestratorParams,
    PrefillParams,
    RouterParams,
    TokenizerParams,
)
from disagg.serve.render import render_config, render_repositories
from disagg.settings import ServeSettings, template_values

pytestmark = pytest.mark.unit


def test_environment_overrides_file_and_defaults(tmp_path):
    toml = tmp_path / "s.toml"
    toml.write_text('prefill_instances = 3\nmode = "colocated"\n')
    s = ServeSettings.load(toml, env={"DISAGG_PREFILL_INSTANCES": "2", "DISAGG_HTTP_PORT": "9100"})
    assert (s.prefill_instances, s.mode, s.http_port) == (2, "colocated", 9100)
    assert s.host == "127.0.0.1" and s.is_loopback


@pytest.mark.parametrize(
    "toml, env, msg",
    [
        ("nonsense = 1\n", {}, "unknown settings"),
        ("", {"DISAGG_DECODE_INSTANCES": "two"}, "expected int"),
        ("", {"DISAGG_DECODE_INSTANCES": "0"}, "decode_instances must be >= 1"),
        ("", {"DISAGG_MODE": "hybrid"}, "mode"),
        ("", {"DISAGG_HOST": "localhost"}, "IP address"),
        ("", {"DISAGG_MAX_TOKENS_LIMIT": "4096"}, "max_tokens_limit"),
        (
            "",
            {"DISAGG_DECODE_ACTIVATIONS": "int4"},
            "decode_activations must be auto, float32, int8 or",
        ),
        ("max_model_len = [", {}, "settings file"),
    ],
)
def test_bad_settings_fail_loudly(tmp_path, toml, env, msg):
    path = tmp_path / "s.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=msg):
        ServeSettings.load(path, env=env)


@pytest.mark.parametrize(
    "settings, mode, why",
    [
        ({}, "conditional", "share this machine's cores"),
        ({"cpus": "0-1", "prefill_instances": 2}, "conditional", "share"),
        ({"prefill_replicas": "10.0.0.2:8001"}, "disaggregated", "its own servers"),
        ({"role": "frontend", "decode_replicas": "10.0.0.3:8001"}, "conditional", "share"),
        (
            {"engine_backend": "tensorrt_llm", "trtllm_prefill_devices": "0",
             "trtllm_decode_devices": "1"},
            "disaggregated", "GPUs of their own",
        ),
        (
            {"engine_backend": "tensorrt_llm", "trtllm_prefill_devices": "0,1",
             "trtllm_decode_devices": "1"},
            "conditional", "share",
        ),
        (
            {"engine_backend": "tensorrt_llm", "trtllm_prefill_devices": "0, 1",
             "trtllm_decode_devices": "1"},
            "conditional", "share",
        ),
        ({"engine_backend": "tensorrt_llm"}, "conditional", "share"),
        ({"mode": "disaggregated"}, "disaggregated", "set"),
        ({"mode": "conditional", "prefill_replicas": "h:1"}, "conditional", "set"),
    ],
)  # fmt: skip
def test_mode_auto_is_disaggregated_only_where_prefill_has_hardware_of_its_own(
    tmp_path, settings, mode, why
):
    s = ServeSettings(**settings)
    assert ServeSettings().mode == "auto"
    got, reason = s.resolved_mode()
    assert got == mode and why in reason
    assert template_values(s, tmp_path)["mode"] == mode  # what the orchestrator is given


@pytest.mark.parametrize(
    "settings, threads_nice",
    [
        ({}, ("1", "10")),  # auto -> conditional, both pools on this CPU: prefill yields
        ({"mode": "conditional"}, ("1", "10")),
        ({"mode": "disaggregated"}, ("1", "10")),  # every prompt remote, on decode's cores
        ({"mode": "colocated"}, ("0", "0")),
        ({"prefill_replicas": "h:1"}, ("0", "0")),  # prefill has servers of its own
        ({"role": "prefill"}, ("0", "0")),
        ({"engine_backend": "tensorrt_llm"}, ("0", "0")),
        ({"prefill_torch_threads": 2}, ("2", "0")),  # set: as set
        ({"prefill_nice": 5}, ("0", "5")),
    ],
)  # fmt: skip
def test_prefill_yields_shared_cores_only_where_both_pools_run_on_one_cpu(
    tmp_path, settings, threads_nice
):
    values = template_values(ServeSettings(**settings), tmp_path)
    assert (values["prefill_torch_threads"], values["prefill_nice"]) == threads_nice


@pytest.mark.parametrize(
    "settings, one_pool",
    [
        ({}, True),  # auto -> conditional: decode yields to its prefill (cpu_share.py)
        ({"mode": "disaggregated"}, True),  # and yields to it likewise
        ({"mode": "colocated"}, True),  # decode prefills its own: the cores are its
        ({"mode": "colocated", "decode_instances": 2}, False),  # two engines share them
        ({"role": "decode"}, True),
        ({"prefill_replicas": "10.0.0.2:8001"}, True),  # prefill on another server
    ],
)  # fmt: skip
def test_decode_keeps_one_openmp_pool_unless_a_second_decode_instance_shares_its_cores(
    tmp_path, settings, one_pool
):
    values = template_values(ServeSettings(**settings), tmp_path)
    assert values["decode_one_pool"] == str(one_pool).lower()


@pytest.mark.parametrize(
    "settings, shared",
    [
        ({}, True),  # auto -> conditional on one CPU server
        ({"mode": "conditional"}, True),
        ({"mode": "disaggregated"}, True),
        ({"mode": "colocated"}, False),  # no prefill pool here
        ({"prefill_replicas": "h:1"}, False),  # prefill has servers of its own
        ({"engine_backend": "tensorrt_llm"}, False),
    ],
)  # fmt: skip
def test_decode_yields_to_its_prefill_only_where_both_pools_share_the_cpu(
    tmp_path, settings, shared
):
    values = template_values(ServeSettings(**settings), tmp_path)
    assert values["cores_shared"] == str(shared).lower()


def test_compute_dtype_defaults_to_auto_and_refuses_others():
    assert ServeSettings().compute_dtype == "auto"
    for ok in ("auto", "float32", "bfloat16"):
        ServeSettings(compute_dtype=ok)
    with pytest.raises(ConfigError, match="auto, float32 or bfloat16"):
        ServeSettings(compute_dtype="float16")


def test_a_template_key_without_a_setting_is_refused():
    with pytest.raises(ConfigError, match=r"\['pool_size'\]"):
        render_config('count: ${pool_size}\nname: "${engine_dir}"', {"engine_dir": "/e"}, "x")


def test_every_template_renders_to_a_valid_model_config(tmp_path):
    settings = ServeSettings(prefill_instances=2, decode_instances=3)
    repos = render_repositories(template_values(settings, tmp_path / "run"), tmp_path / "out")
    configs = {}
    for repo in repos:
        for cfg in repo.glob("*/config.pbtxt"):
            text = cfg.read_text()
            assert "${" not in text
            configs[cfg.parent.name] = text_format.Parse(text, model_config_pb2.ModelConfig())
            assert (cfg.parent / "1").is_dir()
    assert set(configs) == {
        "tokenizer",
        "prefill",
        "decode",
        "orchestrator",
        "orchestrator_sync",
        "router",
        "router_sync",
        "ensemble",
        "ensemble_sync",
    }
    assert configs["prefill"].instance_group[0].count == 2
    assert configs["decode"].instance_group[0].count == 3
    assert configs["decode"].model_transaction_policy.decoupled
    assert not configs["orchestrator_sync"].model_transaction_policy.decoupled
    policy = configs["router"].parameters["router_policy"].string_value
    assert Path(policy).is_absolute() and Path(policy).is_file()
    engine = configs["decode"].parameters["engine_dir"].string_value
    assert Path(engine).is_absolute() and engine.endswith("engines/smollm2-135m-instruct")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    """Every model config as `disagg serve` renders it (the _sync twins are generated)."""
    out = tmp_path_factory.mktemp("rendered")
    repos = render_repositories(template_values(ServeSettings(), out / "run"), out / "repo")
    return {
        cfg.parent.name: text_format.Parse(cfg.read_text(), model_config_pb2.ModelConfig())
        for repo in repos
        for cfg in repo.glob("*/config.pbtxt")
    }


def test_ensemble_steps_name_tensors_that_exist(rendered):
    """Every ensemble step maps inputs/outputs that its model declares, and every ensemble
    input the steps read is declared by the ensemble (or produced by an earlier step)."""
    ensembles = [c for c in rendered.values() if c.platform == "ensemble"]
    assert {e.name for e in ensembles} == {"ensemble", "ensemble_sync"}
    for ens in ensembles:
        available = {i.name for i in ens.input}
        for step in ens.ensemble_scheduling.step:
            model = rendered[step.model_name]
            assert set(step.input_map) <= {i.name for i in model.input}, step.model_name
            assert set(step.input_map.values()) <= available, step.model_name
            assert set(step.output_map) <= {o.name for o in model.output}, step.model_name
            available |= set(step.output_map.values())
        assert {o.name for o in ens.output} <= available


def test_the_router_takes_and_returns_what_the_ensemble_does(rendered):
    """So a client of the ensemble switches to the router by changing the model name."""
    ens = rendered["ensemble"]
    for name in ("router", "router_sync"):
        router = rendered[name]
        router_in = {i.name: (i.data_type, list(i.dims)) for i in router.input}
        for i in ens.input:
            assert router_in[i.name] == (i.data_type, list(i.dims)), (name, i.name)
        router_out = {o.name: o.data_type for o in router.output}
        assert all(router_out[o.name] == o.data_type for o in ens.output), name
        assert all(i.optional for i in router.input), name


def test_sync_twins_are_their_streaming_models_answering_once(rendered):
    """Generated, not hand-kept: same tensors and parameters, one response per request, and
    the ensemble's twin chains the orchestrator's twin."""
    for name in ("router", "orchestrator", "ensemble"):
        stream, sync = rendered[name], rendered[name + "_sync"]
        assert [(i.name, i.data_type, list(i.dims)) for i in stream.input] == [
            (i.name, i.data_type, list(i.dims)) for i in sync.input
        ]
        assert list(stream.output) == list(sync.output)
        assert dict(stream.parameters) == dict(sync.parameters)
        assert not sync.model_transaction_policy.decoupled
        if name != "ensemble":
            assert stream.model_transaction_policy.decoupled
            assert sync.dynamic_batching.max_queue_delay_microseconds == 1000
            ragged = [i.name for i in sync.input if list(i.dims) == [-1]]
            assert ragged and all(i.allow_ragged_batch for i in sync.input if i.name in ragged)
    steps = [s.model_name for s in rendered["ensemble_sync"].ensemble_scheduling.step]
    assert steps == ["tokenizer", "orchestrator_sync"]


def test_model_parameters_are_typed_and_named_as_settings(rendered):
    """Each model reads its config.pbtxt parameters through ModelParams: every key names a
    setting (or a model-only parameter) and comes back in the setting's type."""
    from disagg.model_params import ModelParams

    for name, cfg in rendered.items():
        raw = {k: v.string_value for k, v in cfg.parameters.items()}
        params = ModelParams(raw, name)  # an unknown key would raise here
        for key in raw:
            default = getattr(ServeSettings(), key, None)
            if default is not None:
                assert type(getattr(params, key)) is type(default), (name, key)
    decode = ModelParams({k: v.string_value for k, v in rendered["decode"].parameters.items()})
    config = decode.typed(DecodeParams).engine_config()
    assert config.max_num_seqs == ServeSettings().decode_max_num_seqs
    with pytest.raises(ConfigError, match="name no setting"):
        ModelParams({"max_num_seqs": "4"}, "decode")
    with pytest.raises(ConfigError, match="has no parameter 'mode'"):
        _ = decode.mode


def test_decode_step_budgets_reach_the_engine_from_the_environment(tmp_path):
    """DISAGG_DECODE_PREFILL_CHUNK and DISAGG_DECODE_BURST_TOKENS set decode's per-step
    prompt budgets (beside a batch, and in a burst): rendered, read back, in the engine."""
    from disagg.model_params import ModelParams

    env = {"DISAGG_DECODE_PREFILL_CHUNK": "32", "DISAGG_DECODE_BURST_TOKENS": "512"}
    values = template_values(ServeSettings.load(env=env), tmp_path / "run")
    repo = render_repositories(values, tmp_path / "repo")
    cfg = next(c for r in repo for c in r.glob("decode/config.pbtxt"))
    parsed = text_format.Parse(cfg.read_text(), model_config_pb2.ModelConfig())
    raw = {k: v.string_value for k, v in parsed.parameters.items()}
    config = ModelParams(raw, "decode").typed(DecodeParams).engine_config()
    assert (config.prefill_chunk_tokens, config.burst_prefill_tokens) == (32, 512)


MODEL_PARAMS = {
    "tokenizer": TokenizerParams,
    "prefill": PrefillParams,
    "decode": DecodeParams,
    "orchestrator": OrchestratorParams,
    "orchestrator_sync": OrchestratorParams,
    "router": RouterParams,
    "router_sync": RouterParams,
}


def test_each_model_reads_its_whole_config_into_its_typed_params(rendered):
    """Each model's dataclass (model_params.py) names exactly the parameters its config.pbtxt
    carries, each of the type ModelParams parses it into: initialize reads them all."""
    from dataclasses import fields

    from disagg.model_params import ModelParams

    with_params = {name for name, cfg in rendered.items() if cfg.parameters}
    assert with_params == set(MODEL_PARAMS)
    for name, cls in MODEL_PARAMS.items():
        raw = {k: v.string_value for k, v in rendered[name].parameters.items()}
        assert {f.name for f in fields(cls)} == set(raw), name
        typed = ModelParams(raw, name).typed(cls)
        for f in fields(cls):
            assert type(getattr(typed, f.name)).__name__ == f.type, (name, f.name)
    with pytest.raises(ConfigError, match="prefill: its config.pbtxt has no parameter"):
        ModelParams({"engine_dir": "/e"}, "prefill").typed(PrefillParams)


def test_settings_come_in_groups_and_a_toml_table_per_group(tmp_path):
    from dataclasses import fields

    from disagg.settings import GROUPS

    names = [n for group in GROUPS.values() for n in group]
    assert sorted(names) == sorted(f.name for f in fields(ServeSettings))  # each in one group
    assert set(GROUPS) == {"server", "pools", "tensorrt_llm", "cluster", "gateway", "paths"}
    toml = tmp_path / "s.toml"
    toml.write_text("[pools]\nprefill_instances = 3\n[gateway]\ngateway_rpm = 5\n")
    s = ServeSettings.load(toml, env={})
    assert (s.prefill_instances, s.gateway_rpm) == (3, 5)
    toml.write_text("[gateway]\nprefill_instances = 3\n")
    with pytest.raises(ConfigError, match="not in group"):
        ServeSettings.load(toml, env={})


def test_bf16_decode_activations_are_refused_before_triton_starts_on_a_cpu_without_them():
    from disagg.serve.__main__ import preflight

    bf16 = ServeSettings(decode_activations="bfloat16")
    with pytest.raises(ConfigError, match="AVX512-BF16.*use float32 or int8"):
        preflight(bf16, ["fpu", "avx2", "fma"])
    preflight(bf16, ["avx2", "avx512f", "avx512_bf16"])  # has them
    with pytest.raises(ConfigError, match="AVX512-BF16"):  # the prefill pool computes so too
        preflight(ServeSettings(decode_activations="bfloat16", role="prefill"), ["avx2"])
    preflight(ServeSettings(decode_activations="int8"), ["avx2"])
    preflight(bf16, None)  # flags unknown: the pool tells at load
