"""A predicted sweep in bench's shape: goodput counted by bench's own code; traces;
topology specs."""

from __future__ import annotations

import json

import pytest
from helpers.profiles import simple_profile

from disagg.bench import report as R
from disagg.bench.stats import SLO
from disagg.bench.sweep import SweepConfig
from disagg.errors import ConfigError
from disagg.planner.sweep import load_trace, simulate_sweep, trace_rate
from disagg.planner.topology import Topology

pytestmark = pytest.mark.unit
P = simple_profile()


def test_goodput_is_the_highest_rate_whose_requests_meet_the_slo():
    cfg = SweepConfig("decode-heavy", (0.05, 50.0), num_requests=30, warmup=2)
    sweep = simulate_sweep(P, Topology.parse("colocated:1d"), cfg)
    slo = {"decode": SLO(ttft_s=1.0, tpot_s=0.05)}
    res = R.summarize_sweep(sweep, slo)
    # at 0.05/s each request runs alone; at 50/s 30 requests of 256 tokens share 16 slots
    assert res["by_rate"][0.05]["decode"].slo_attainment == 1.0
    assert res["by_rate"][50.0]["decode"].slo_attainment < 0.9
    assert res["goodput"]["decode"] == 0.05
    assert sweep["predicted"] and sweep["server"]["served_by=colocated"] == 30 * 2 + 3


def test_all_requests_are_judged_by_their_own_class_slo():
    cfg = SweepConfig("interference", (0.1,), num_requests=40, warmup=0)
    sweep = simulate_sweep(P, Topology.parse("disaggregated:1p1d"), cfg)
    impossible, easy = SLO(ttft_s=1e-4, tpot_s=1.0), SLO(ttft_s=100.0, tpot_s=1.0)
    res = R.summarize_sweep(sweep, {"short": impossible, "long": easy})
    by_cls = res["by_rate"][0.1]
    share_long = by_cls["long"].num_requests / by_cls["all"].num_requests
    assert by_cls["short"].slo_attainment == 0 and by_cls["long"].slo_attainment == 1
    assert by_cls["all"].slo_attainment == pytest.approx(share_long)


def test_the_same_seed_predicts_the_same_sweep():
    cfg = SweepConfig("mixed", (0.5,), num_requests=20, warmup=2)
    t = Topology.parse("conditional:1p1d")
    assert simulate_sweep(P, t, cfg)["rates"] == simulate_sweep(P, t, cfg)["rates"]


def test_a_trace_is_read_sorted_and_replayed_from_its_first_arrival(tmp_path):
    lines = [
        {"arrival_s": 12.0, "prompt_tokens": 100, "output_tokens": 5, "class": "b"},
        {"arrival_s": 10.0, "prompt_tokens": 50, "output_tokens": 3},
        {"arrival_s": 11.0, "prompt_tokens": 20, "output_tokens": 4, "class": "b"},
    ]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    specs = load_trace(jsonl)
    assert [(s.arrival_s, s.prompt_tokens, s.cls) for s in specs] == [
        (0.0, 50, "trace"), (1.0, 20, "b"), (2.0, 100, "b"),
    ]  # fmt: skip
    assert trace_rate(specs) == pytest.approx(1.0)
    csv = tmp_path / "t.csv"
    csv.write_text("arrival_s,prompt_tokens,output_tokens,class\n0.5,64,8,x\n0,32,4,y\n")
    assert [s.cls for s in load_trace(csv)] == ["y", "x"]
    cfg = SweepConfig("trace", (), num_requests=3, warmup=0)
    sweep = simulate_sweep(P, Topology.parse("colocated:1d"), cfg, trace=specs)
    (rate,) = sweep["rates"]
    assert len(sweep["rates"][rate]) == 3 and float(rate) == pytest.approx(1.0)


def test_a_trace_missing_a_field_names_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n{"arrival_s": 1}\n')
    with pytest.raises(ConfigError, match="line 2"):
        load_trace(bad)


@pytest.mark.parametrize(
    "spec, mode, prefill, decode, nodes",
    [
        ("disaggregated:2p1d", "disaggregated", 2, 1, 3),
        ("colocated:2", "colocated", 0, 2, 2),
        ("colocated:3d", "colocated", 0, 3, 3),
        ("conditional:1p1d@shared", "conditional", 1, 1, 1),
    ],
)
def test_topology_specs(spec, mode, prefill, decode, nodes):
    t = Topology.parse(spec)
    assert (t.mode, t.num_prefill, t.num_decode, t.num_nodes) == (mode, prefill, decode, nodes)
    assert Topology.parse(t.name) == t


@pytest.mark.parametrize("bad", ["disaggregated:2", "fused:1p1d", "colocated", "conditional:0p1d"])
def test_bad_topology_specs_are_refused(bad):
    with pytest.raises(ConfigError):
        Topology.parse(bad)


def test_a_server_topology_comes_from_its_settings():
    from disagg.settings import ServeSettings

    t = Topology.from_settings(ServeSettings(mode="colocated", decode_max_num_seqs=8))
    assert (t.mode, t.num_decode, t.max_num_seqs, t.shared, t.num_nodes) == (
        "colocated", 1, 8, True, 1,
    )  # fmt: skip
    auto = Topology.from_settings(ServeSettings())
    assert auto.mode == "conditional" and auto.stall_prior == 0.5
