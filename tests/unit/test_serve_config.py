"""Settings and model config templates, without starting a server."""

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from disagg.errors import ConfigError
from disagg.serve.render import render_config, render_repositories
from disagg.serve.settings import ServeSettings, template_values

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
        ("max_model_len = [", {}, "settings file"),
    ],
)
def test_bad_settings_fail_loudly(tmp_path, toml, env, msg):
    path = tmp_path / "s.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=msg):
        ServeSettings.load(path, env=env)


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
    policy = configs["router"].parameters["policy"].string_value
    assert Path(policy).is_absolute() and Path(policy).is_file()
    engine = configs["decode"].parameters["engine_dir"].string_value
    assert Path(engine).is_absolute() and engine.endswith("engines/smollm2-135m-instruct")


def test_ensemble_steps_name_tensors_that_exist():
    """Every ensemble step maps inputs/outputs that its model declares, and every ensemble
    input the steps read is declared by the ensemble (or produced by an earlier step)."""
    from disagg.serve.settings import ROOT

    def parse(path):
        text = render_config(path.read_text(), {k: "1" for k in _keys(path)}, str(path))
        return text_format.Parse(text, model_config_pb2.ModelConfig())

    models = {p.parent.name: parse(p) for p in (ROOT / "model_repository").glob("*/config.pbtxt")}
    for ens_path in (ROOT / "ensembles").glob("*/config.pbtxt"):
        ens = parse(ens_path)
        available = {i.name for i in ens.input}
        for step in ens.ensemble_scheduling.step:
            model = models[step.model_name]
            assert set(step.input_map) <= {i.name for i in model.input}, step.model_name
            assert set(step.input_map.values()) <= available, step.model_name
            assert set(step.output_map) <= {o.name for o in model.output}, step.model_name
            available |= set(step.output_map.values())
        assert {o.name for o in ens.output} <= available


def test_the_router_takes_and_returns_what_the_ensemble_does():
    """So a client of the ensemble switches to the router by changing the model name."""
    from disagg.serve.settings import ROOT

    def parse(path):
        text = render_config(path.read_text(), {k: "1" for k in _keys(path)}, str(path))
        return text_format.Parse(text, model_config_pb2.ModelConfig())

    ens = parse(ROOT / "ensembles/ensemble/config.pbtxt")
    for name in ("router", "router_sync"):
        router = parse(ROOT / f"model_repository/{name}/config.pbtxt")
        router_in = {i.name: (i.data_type, list(i.dims)) for i in router.input}
        for i in ens.input:
            assert router_in[i.name] == (i.data_type, list(i.dims)), (name, i.name)
        router_out = {o.name: o.data_type for o in router.output}
        assert all(router_out[o.name] == o.data_type for o in ens.output), name
        assert all(i.optional for i in router.input), name


def _keys(path):
    import re

    return set(re.findall(r"\$\{(\w+)\}", path.read_text()))
