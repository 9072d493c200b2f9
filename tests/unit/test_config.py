import json

import pytest

from disagg.engine.config import EngineConfig, ModelArgs, load_model_args
from disagg.errors import ConfigError

pytestmark = pytest.mark.unit


def test_model_args_derive_head_dim_and_groups():
    a = ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536, vocab_size=49152)
    assert (a.head_dim, a.n_groups) == (64, 3)
    assert a.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"n_heads": 7}, "divide"),
        ({"architecture": "gpt2"}, "architecture"),
        ({"dtype": "bfloat16"}, "dtype"),
    ],
)
def test_bad_model_args_fail_loudly(kw, msg):
    base = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=8, vocab_size=10)
    with pytest.raises(ConfigError, match=msg):
        ModelArgs(**{**base, **kw})


def test_engine_config_defaults_budget_from_batch_and_length():
    c = EngineConfig(max_num_seqs=4, max_model_len=100, block_size=16)
    assert c.num_kv_blocks == 4 * 7


@pytest.mark.parametrize(
    "kw",
    [
        {"max_num_seqs": 0},
        {"block_size": -1},
        {"max_queue": 1.5},
        {"max_model_len": True},
        {"burst_prefill_tokens": 0},  # a burst would never be prefilled: refused, not a hang
    ],
)
def test_bad_engine_config_fails_loudly(kw):
    with pytest.raises(ConfigError):
        EngineConfig(**kw)


def test_missing_or_stale_engine_dir_is_explained(tmp_path):
    with pytest.raises(ConfigError, match="build the engine"):
        load_model_args(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"format_version": 0}))
    with pytest.raises(ConfigError, match="rebuild"):
        load_model_args(tmp_path)
