"""The benchmark harness's statistics on synthetic timelines with known answers, and its
workloads' reproducibility and distributions."""

from __future__ import annotations

import numpy as np
import pytest

from disagg.bench import workloads as W
from disagg.bench.report import markdown_table, slos, summarize_sweep
from disagg.bench.stats import (
    SLO,
    Dist,
    Timeline,
    bootstrap_sd,
    calibrate_slo,
    goodput_rate,
    measured,
    rerun_needs,
    summarize,
)

pytestmark = pytest.mark.unit


def steady(cls: str, send: float, ttft: float, gap: float, n: int, error: str = "") -> Timeline:
    """A request sent at `send` whose n tokens arrive one per chunk: the first after `ttft`,
    then every `gap` seconds."""
    chunks = [send + ttft + k * gap for k in range(n)]
    return Timeline(
        cls, send, chunks, [1] * n, end_s=chunks[-1], prompt_tokens=10, output_tokens=n,
        error=error,
    )  # fmt: skip


def test_one_timeline_gives_its_ttft_tpot_itl_and_e2e():
    t = steady("a", 10.0, 0.5, 0.1, 11)
    assert t.ttft == pytest.approx(0.5)
    assert t.tpot == pytest.approx(0.1)
    assert t.e2e == pytest.approx(1.5)
    assert t.itls() == pytest.approx([0.1] * 10)


def test_a_chunk_of_several_tokens_spreads_its_gap_over_them():
    t = Timeline("a", 0.0, [1.0, 1.3, 1.4], [1, 3, 1], end_s=1.4, output_tokens=5)
    assert t.itls() == pytest.approx([0.1, 0.1, 0.1, 0.1])  # 0.3 s over 3 tokens, then 0.1
    assert t.tpot == pytest.approx(0.4 / 4)


def test_percentiles_match_numpy_on_known_values():
    d = Dist.of([float(v) for v in range(1, 101)])
    assert (d.mean, d.p50, d.p90, d.p99, d.n) == pytest.approx((50.5, 50.5, 90.1, 99.01, 100))
    assert Dist.of([]).n == 0


def test_summary_throughput_attainment_and_goodput_per_second():
    # 4 requests over a 10 s window: sends at 0, 1, 2, 3; each 11 tokens
    ts = [steady("a", s, ttft, 0.1, 11) for s, ttft in ((0, 0.2), (1, 0.2), (2, 0.9), (3, 8.9))]
    s = summarize(ts, "a", SLO(ttft_s=0.5, tpot_s=0.2))
    assert s.num_requests == 4 and s.num_errors == 0
    assert s.ttft.p50 == pytest.approx(0.55)  # median of 0.2, 0.2, 0.9, 8.9
    assert s.slo_attainment == pytest.approx(0.5)  # two TTFTs over 0.5 s
    window = (3 + 8.9 + 1.0) - 0  # last end - first send
    assert s.output_tokens_per_s == pytest.approx(44 / window)
    assert s.requests_per_s == pytest.approx(4 / window)
    assert s.goodput_requests_per_s == pytest.approx(2 / window)


def test_errors_and_slow_decoding_miss_the_slo():
    ok = steady("a", 0, 0.1, 0.05, 5)
    slow = steady("a", 0, 0.1, 0.5, 5)  # TPOT 0.5 > 0.2
    failed = steady("a", 0, 0.1, 0.05, 5, error="boom")
    one_token = steady("a", 0, 0.1, 0.05, 1)  # no TPOT: judged on TTFT alone
    slo = SLO(0.2, 0.2)
    assert [slo.met(t) for t in (ok, slow, failed, one_token)] == [True, False, False, True]
    s = summarize([ok, slow, failed], "a", slo)
    assert s.num_errors == 1 and s.slo_attainment == pytest.approx(1 / 3)
    assert s.ttft.n == 2  # latency statistics only over requests that finished


def test_per_class_slos_judge_all_by_each_requests_class():
    ts = [steady("fast", 0, 0.1, 0.01, 3), steady("slow", 0, 1.0, 0.01, 3)]
    per_class = {"fast": SLO(0.2, 1.0), "slow": SLO(2.0, 1.0)}
    assert summarize(ts, "all", per_class).slo_attainment == 1.0
    assert summarize(ts, "all", SLO(0.2, 1.0)).slo_attainment == 0.5


def test_warm_up_drops_the_earliest_sent():
    ts = [steady("a", s, 0.1, 0.1, 2) for s in (3.0, 1.0, 2.0, 0.0)]
    assert [t.send_s for t in measured(ts, 2)] == [2.0, 3.0]


def test_goodput_is_the_highest_rate_before_the_first_miss():
    assert goodput_rate({0.5: 1.0, 1.0: 0.95, 2.0: 0.6, 4.0: 0.92}) == 1.0
    assert goodput_rate({0.5: 0.8, 1.0: 1.0}) == 0.0
    assert goodput_rate({0.5: 0.9}) == 0.5  # the target itself counts


def test_slo_calibration_scales_unloaded_medians():
    unloaded = [
        steady("a", 0, ttft, tpot, 11) for ttft, tpot in ((0.1, 0.02), (0.2, 0.04), (0.3, 0.03))
    ]
    slo = calibrate_slo(unloaded, ttft_factor=3, tpot_factor=2)
    assert (slo.ttft_s, slo.tpot_s) == pytest.approx((0.6, 0.06))
    with pytest.raises(ValueError):
        calibrate_slo([steady("a", 0, 0.1, 0.1, 2, error="x")])


def test_report_takes_the_best_modes_unloaded_latency_and_finds_goodput():
    def sweep(ttft: float) -> dict:
        from dataclasses import asdict

        unloaded = [asdict(steady("a", 0, ttft, 0.05, 5)) for _ in range(3)]
        rates = {
            "0.5": [asdict(steady("a", i, ttft, 0.05, 5)) for i in range(6)],
            "1.0": [asdict(steady("a", i, 10 * ttft, 0.05, 5)) for i in range(6)],
        }
        return {"config": {"warmup": 1}, "unloaded": unloaded, "rates": rates}

    fast, slow = sweep(0.1), sweep(0.4)
    slo = slos([fast, slow], ttft_factor=3, tpot_factor=2)
    assert slo["a"].ttft_s == pytest.approx(0.3)  # 3 x the faster mode's 0.1 s
    res = {"fast": summarize_sweep(fast, slo), "slow": summarize_sweep(slow, slo)}
    assert res["fast"]["goodput"]["a"] == 0.5  # meets at 0.5/s, not at 1/s (TTFT 1 s)
    assert res["slow"]["goodput"]["a"] == 0.0
    table = markdown_table("w", res, slo)
    assert "| fast | a | 100% | 0% | 0.5 |" in table


def test_workloads_are_reproducible_and_follow_their_mix():
    w = W.WORKLOADS["interference"]
    a, b = W.build(w, 2.0, 400, seed=7), W.build(w, 2.0, 400, seed=7)
    assert a == b
    assert W.build(w, 2.0, 400, seed=8) != a
    long = [s for s in a if s.cls == "long"]
    assert 0.15 < len(long) / len(a) < 0.25  # 20% long
    assert {(s.prompt_tokens, s.max_tokens) for s in long} == {(W.MAX_PROMPT, 16)}


def test_arrivals_are_poisson_at_the_offered_rate_and_scale_with_it():
    w = W.WORKLOADS["chat"]
    specs = W.build(w, 4.0, 4000, seed=1)
    gaps = np.diff([s.arrival_s for s in specs])
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: sd == mean
    slower = W.build(w, 1.0, 4000, seed=1)
    assert slower[10].arrival_s == pytest.approx(4 * specs[10].arrival_s)
    assert [s.prompt_tokens for s in slower] == [s.prompt_tokens for s in specs]


def test_chat_lengths_are_lognormal_around_their_means():
    specs = W.build(W.WORKLOADS["chat"], 1.0, 5000, seed=3)
    prompts = np.array([s.prompt_tokens for s in specs])
    assert prompts.mean() == pytest.approx(256, rel=0.05)
    assert prompts.min() >= 16 and prompts.max() <= 1024
    assert np.median(prompts) < prompts.mean()  # right-skewed


def test_mixed_workload_tags_latency_critical_requests_for_the_router():
    specs = W.build(W.WORKLOADS["mixed"], 1.0, 200, seed=0)
    critical = [s for s in specs if s.cls == "critical"]
    assert critical and all(s.hints["latency_sla_ms"] == 150.0 for s in critical)
    assert all(not s.hints for s in specs if s.cls == "standard")


def test_bad_rates_are_refused():
    with pytest.raises(ValueError):
        W.build(W.WORKLOADS["chat"], 0.0, 10, 0)


def test_plots_and_the_doc_section_are_written(tmp_path):
    from dataclasses import asdict

    from disagg.bench import cli
    from disagg.bench.report import plot_workload

    def sweep(ttft):
        rows = [asdict(steady("a", i, ttft, 0.05, 5)) for i in range(5)]
        return {"config": {"warmup": 1}, "unloaded": rows[:2], "rates": {"0.5": rows, "1.0": rows}}

    sweeps = {"colocated": sweep(0.1), "disaggregated": sweep(0.2)}
    slo = slos(list(sweeps.values()), 3, 2)
    results = {m: summarize_sweep(s, slo) for m, s in sweeps.items()}
    png = tmp_path / "w.png"
    plot_workload("w", sweeps, results, slo, png)
    assert png.read_bytes()[:4] == b"\x89PNG"
    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    cli._write_doc(doc, ["first"], "python client/benchmark.py compare")
    cli._write_doc(doc, ["second"], "python client/benchmark.py compare")  # replaces, once
    text = doc.read_text()
    assert text.count(cli.DOC_BEGIN) == 1 and "second" in text and "first" not in text
    assert text.startswith("# Benchmarks\n\nkept\n")


def test_slo_overrides_and_the_detail_table():
    from dataclasses import asdict

    from disagg.bench.report import detail_table, parse_slo_overrides, summary_json

    over = parse_slo_overrides(["a=500:80"])
    assert over == {"a": SLO(0.5, 0.08)}
    with pytest.raises(ValueError, match="CLASS=TTFT_MS:TPOT_MS"):
        parse_slo_overrides(["a=500"])
    rows = [asdict(steady("a", i, 0.4, 0.05, 5)) for i in range(4)]
    sweep = {"config": {"warmup": 0}, "unloaded": rows[:1], "rates": {"1.0": rows}}
    slo = slos([sweep], 3, 2, overrides=over)
    assert slo == over  # the override wins over calibration (which would give 1.2 s)
    res = {"m": summarize_sweep(sweep, slo)}
    table = detail_table(res)
    assert "| m | 1 | a | 4 | 400/400/400/400 | 50/50/50/50 |" in table
    assert summary_json(res, slo)["modes"]["m"]["by_rate"]["1.0"]["a"]["slo_attainment"] == 1.0


def test_a_percentiles_bootstrap_spread_and_the_run_size_that_keeps_a_rerun_within_5_points():
    rng = np.random.default_rng(0)
    assert bootstrap_sd(np.full(50, 2.0), 90, rng) == 0.0  # no spread in the values: none
    assert np.isnan(bootstrap_sd(np.array([1.0]), 50, rng))
    wide = np.random.default_rng(1).exponential(1.0, 400)
    small, large = bootstrap_sd(wide[:50], 90, rng), bootstrap_sd(wide, 90, rng)
    assert 1.5 < small / large < 4.5  # ~ sqrt(400 / 50) = 2.8: spread goes as 1/sqrt(n)
    # one run's 10% relative spread at n = 56: a rerun within 5 points at 90% needs
    # 56 * (0.10 / (0.05 / (1.645 * sqrt(2))))^2 = 56 * 21.6 = 1,213 values
    assert rerun_needs(56, 0.10, 5.0) == 1213
    assert rerun_needs(56, 0.01, 5.0) == 13 and rerun_needs(56, float("nan"), 5.0) == 0
