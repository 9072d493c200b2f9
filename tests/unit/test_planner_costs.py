"""The profile's cost models, their fits from raw samples, and the profile file."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.profiles import simple_profile

from disagg.cpuinfo import read_cpuinfo
from disagg.errors import ConfigError
from disagg.planner.costs import (
    ChunkCost,
    PiecewiseLinear,
    fit_chunk,
    fit_decode,
    fit_linear,
    fit_piecewise,
    nondecreasing,
)
from disagg.planner.machine import cpu_info
from disagg.planner.profile import NETWORK, SHM, Profile, fit_profile

pytestmark = pytest.mark.unit


def test_piecewise_linear_interpolates_holds_below_and_extends_above():
    f = PiecewiseLinear((10.0, 20.0, 40.0), (1.0, 2.0, 6.0))
    assert f(15) == pytest.approx(1.5) and f(30) == pytest.approx(4.0)
    assert f(1) == 1.0  # below the first knot: its value
    assert f(50) == pytest.approx(8.0)  # past the last: the last slope (0.2 per unit)
    with pytest.raises(ValueError):
        PiecewiseLinear((2.0, 1.0), (1.0, 2.0))


def test_nondecreasing_pools_violators():
    assert nondecreasing([1, 3, 2, 4]) == pytest.approx([1, 2.5, 2.5, 4])
    assert nondecreasing([5, 1, 1]) == pytest.approx([7 / 3] * 3)
    assert nondecreasing([1, 2, 3]) == [1, 2, 3]


def test_a_noisy_point_does_not_make_a_longer_prompt_cheaper():
    f = fit_piecewise([16, 16, 256, 1024, 2000], [0.02, 0.04, 0.5, 0.4, 3.0])
    values = [f(n) for n in (16, 100, 256, 700, 1024, 1500, 2000)]
    assert values == sorted(values) and f(16) == pytest.approx(0.03)  # the median of two


def test_past_a_kernel_break_a_longer_prompt_may_cost_less_and_each_side_stays_monotone():
    # measured on a Zen 4 (2026-12-06): 64 rows on the block kernel as slow as 128 on dense
    xs = [16, 64, 65, 128, 256, 300]
    ys = [0.025, 0.077, 0.040, 0.077, 0.152, 0.150]  # (the 300 a noisy point)
    f = fit_piecewise(xs, ys, breaks=[64])
    assert f(64) == pytest.approx(0.077) and f(65) == pytest.approx(0.040)
    assert f(100) < f(64)
    right = [f(n) for n in (65, 128, 256, 300)]
    assert right == sorted(right)
    pooled = fit_piecewise(xs, ys)  # without the break: 64 and 65 averaged, both wrong
    assert pooled(64) == pytest.approx(pooled(65)) == pytest.approx((0.077 + 0.040) / 2)


def test_fit_linear_recovers_a_line_and_never_goes_negative():
    xs = [1e6, 2e7, 5e7, 9e7]
    line = fit_linear(xs, [0.001 + 2e-10 * x for x in xs])
    assert line.fixed_s == pytest.approx(0.001) and line.per_unit_s == pytest.approx(2e-10)
    through_zero = fit_linear([1, 2, 3], [0.5, 2.0, 3.5])  # intercept -1: refit through 0
    assert through_zero.fixed_s == 0 and through_zero.per_unit_s > 0
    assert fit_linear([1, 2], [2.0, 1.0]).per_unit_s == 0  # falling: a constant


def test_fit_chunk_recovers_matmul_and_attention_terms():
    ns, starts = [32, 64, 256, 64, 256, 512], [0, 0, 0, 1024, 1024, 1536]
    truth = lambda n, s: 0.002 + 0.001 * n + 3e-7 * n * (s + n)  # noqa: E731
    c = fit_chunk(ns, starts, [truth(n, s) for n, s in zip(ns, starts, strict=True)])
    assert (c.fixed_s, c.per_token_s, c.per_pair_s) == pytest.approx((0.002, 0.001, 3e-7))
    assert c(64, 1024) > c(64, 0)
    for n, s in ((32, 0), (100, 700), (512, 1536)):  # a line's matmul knots are the line
        assert c(n, s) == pytest.approx(truth(n, s))
    assert ChunkCost.from_json(c.to_json()) == c
    old = {"fixed_s": 0.002, "per_token_s": 0.001, "per_pair_s": 3e-7}  # a profile before
    assert ChunkCost.from_json(old)(64, 0) == pytest.approx(truth(64, 0))


def test_a_chunk_past_the_kernel_break_is_charged_its_own_measured_time():
    # the Zen 4 profile's medians (s): 32 rows 42.8 ms, 64 82.7 on the blocks, 128 82.8
    # on the dense copy; the attention term is small at start 0
    samples = [(16, 0.025), (32, 0.0428), (64, 0.0827), (65, 0.046), (128, 0.0828), (256, 0.157)]
    ns, ys = [n for n, _ in samples], [y for _, y in samples]
    line = fit_chunk(ns, [0] * len(ns), ys)
    kinked = fit_chunk(ns, [0] * len(ns), ys, breaks=[64])
    errors = [abs(kinked(n, 0) / y - 1) for n, y in samples]
    assert max(errors) < 0.02, errors
    assert abs(line(64, 0) / 0.0827 - 1) > 0.1  # what one line made of it
    assert kinked(65, 0) < kinked(64, 0)


def test_fit_decode_is_a_line_in_positions_per_batch_size_made_monotone():
    rows, positions, ys = [], [], []
    for b in (1, 4, 16):
        for t in (128, 1024):
            rows.append(b)
            positions.append(t)
            ys.append(0.02 + 0.001 * b + 1e-6 * b * t)
    d = fit_decode(rows, positions, ys)
    assert d(4, 512) == pytest.approx(0.02 + 0.004 + 1e-6 * 4 * 512)
    assert d(10, 512) > d(4, 512) and d(4, 1024) > d(4, 128)
    # a batch of 16 measured faster than 4 (noise) is not believed
    noisy = fit_decode([1, 4, 16], [100, 100, 100], [0.02, 0.05, 0.03])
    assert noisy(16, 100) >= noisy(4, 100) >= noisy(1, 100)


def test_fit_profile_gives_the_costs_the_samples_came_from():
    rng = np.random.default_rng(0)
    kv = 46080

    def noisy(y: float) -> float:
        return y * (1 + 0.01 * rng.standard_normal())

    samples = {
        "prefill": [[n, noisy(0.0015 * n)] for n in (32, 256, 1024)],
        "chunk": [
            [n, s, noisy(0.001 * n + 2e-7 * n * (s + n))] for n in (64, 256) for s in (0, 1024)
        ],
        "decode": [[b, t, noisy(0.02 + 0.002 * b)] for b in (1, 4, 16) for t in (128, 1024)],
        "kv_write": [[n * kv, 1e-10 * n * kv] for n in (64, 512, 2000)],
        "pack": [[n * kv, 2e-10 * n * kv] for n in (64, 512, 2000)],
        SHM: [[n * kv, 0.001 + 1e-9 * n * kv] for n in (64, 512, 2000)],
        NETWORK: [[n * kv, 0.002 + 1e-9 * n * kv] for n in (64, 512, 2000)],
    }
    p = fit_profile(samples, kv)
    assert p.prefill(1024) == pytest.approx(1.536, rel=0.03)
    assert p.decode(4, 500) == pytest.approx(0.028, rel=0.05)
    assert p.handoff_s(NETWORK, 1024) == pytest.approx(
        0.002 + 1e-9 * p.payload_bytes(1024), rel=1e-6
    )
    assert p.handoff_s(NETWORK, 1024) > p.handoff_s(SHM, 1024)


def test_the_profile_file_round_trips(tmp_path):
    p = simple_profile(samples={"prefill": [[16.0, 0.02]]}, mixed_factor=1.25, threads=1)
    path = tmp_path / "profile.json"
    p.save(path)
    back = Profile.load(path)
    assert back == p
    assert back.to_json() == json.loads(path.read_text())


def test_a_file_that_is_not_a_profile_is_refused(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": "something/1"}))
    with pytest.raises(ConfigError, match="not a disagg profile"):
        Profile.load(path)
    data = simple_profile().to_json()
    del data["costs"]["decode"]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="incomplete"):
        Profile.load(path)
    with pytest.raises(ConfigError, match="disagg profile --out"):
        Profile.load(tmp_path / "missing.json")


def test_cpu_info_reads_the_model_and_the_flags_that_pick_kernels():
    text = (
        "processor: 0\nmodel name\t: Intel Xeon Platinum\n"
        "flags\t\t: fpu sse avx2 fma amx_bf16 avx512f\n"
    )
    model, flags = cpu_info(text)
    assert model == "Intel Xeon Platinum"
    assert flags == ["avx2", "fma", "avx512f", "amx_bf16"]


def test_one_cpuinfo_reader_takes_the_first_cpu_and_arm_features():
    two = "model name: A\nflags: avx2 fma\n\nmodel name: B\nflags: avx512_bf16\n"
    assert read_cpuinfo(two) == ("A", ["avx2", "fma"])
    assert read_cpuinfo("Features\t: fp asimd bf16\n") == ("", ["fp", "asimd", "bf16"])
    assert read_cpuinfo("processor: 0\n") == ("", [])
