"""`disagg profile --quick` on the real engine: it writes a profile whose fitted costs are
positive and grow with the work (longer prompts, bigger batches, longer contexts, more
bytes), describing this machine and this model. No timing targets: only shapes."""

from __future__ import annotations

import json
import os

import pytest

from disagg import cli
from disagg.planner.profile import NETWORK, SHM, Profile

pytestmark = pytest.mark.model
DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cpu")  # as conftest.py reads it


def nondecreasing(values: list[float]) -> bool:
    return all(b >= a for a, b in zip(values, values[1:], strict=False))


@pytest.fixture(scope="module")
def profile(engine_dir, tmp_path_factory) -> Profile:
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    argv = ["profile", "--quick", "--engine-dir", str(engine_dir), "--device", DEVICE]
    assert cli.main([*argv, "--out", str(out)]) == 0
    return Profile.load(out)


def test_the_fitted_costs_are_positive_and_grow_with_the_work(profile):
    prompts = [16, 64, 256, 1024, 2000]
    prefill = [profile.prefill(n) for n in prompts]
    assert min(prefill) > 0 and nondecreasing(prefill) and prefill[-1] > prefill[0]
    chunks = [profile.chunk(n, s) for n, s in ((16, 0), (64, 0), (64, 1024), (256, 1024))]
    assert min(chunks) > 0 and nondecreasing(chunks)
    for positions in (64, 1024, 2000):
        steps = [profile.decode(b, positions) for b in (1, 2, 4, 8, 16, 32)]
        assert min(steps) > 0 and nondecreasing(steps)
    assert nondecreasing([profile.decode(8, t) for t in (64, 512, 1024, 2000)])
    sizes = [profile.payload_bytes(n) for n in (16, 512, 2000)]
    for cost in (profile.pack, profile.kv_write, profile.handoff[SHM], profile.handoff[NETWORK]):
        values = [cost(b) for b in sizes]
        assert min(values) > 0 and nondecreasing(values)
    assert profile.mixed_factor > 0


def test_the_profile_says_where_and_what_it_measured(profile, engine_dir):
    config = json.loads((engine_dir / "config.json").read_text())
    assert profile.model["fingerprint"] == config["fingerprint"]
    assert (
        profile.kv_bytes_per_token
        == 2 * config["n_layers"] * config["n_kv_heads"] * (config["dim"] // config["n_heads"]) * 4
    )
    assert profile.machine["cpu"] and profile.machine["torch"] and profile.machine["cores"] >= 1
    assert profile.device.startswith(DEVICE) and profile.quick and profile.threads >= 1
    for kind in ("prefill", "chunk", "decode", "mixed", "kv_write", "pack", SHM, NETWORK):
        assert profile.samples[kind], kind
