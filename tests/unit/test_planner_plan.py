"""`disagg plan`: the candidates it searches, the goodput search, and its table."""

from __future__ import annotations

import argparse

import pytest
from helpers.profiles import simple_profile

from disagg.bench.stats import SLO
from disagg.planner import options
from disagg.planner.plan import Evaluator, main, topologies
from disagg.planner.topology import Topology

pytestmark = pytest.mark.unit


def test_every_split_of_the_nodes_is_a_candidate():
    names = [t.name for t in topologies(4, ("colocated", "disaggregated", "conditional"))]
    assert names == [
        "colocated:4d",
        "disaggregated:1p3d", "disaggregated:2p2d", "disaggregated:3p1d",
        "conditional:1p3d", "conditional:2p2d", "conditional:3p1d",
    ]  # fmt: skip
    assert all(t.num_nodes == 4 for t in topologies(4, ("colocated", "disaggregated")))
    assert [t.name for t in topologies(1, ("colocated", "disaggregated"))] == ["colocated:1d"]


def small_trace(path, num: int = 30) -> str:
    """`num` requests of 32 prompt and 24 output tokens, one a second."""
    lines = [f'{{"arrival_s": {i}, "prompt_tokens": 32, "output_tokens": 24}}' for i in range(num)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def requests(tmp_path, num: int = 30) -> options.Requests:
    trace = small_trace(tmp_path / "trace.jsonl", num)
    return options.Requests(
        argparse.Namespace(trace=trace, workload="chat", num_requests=0, seed=0)
    )


def test_goodput_grows_with_decode_nodes(tmp_path):
    ev = Evaluator(simple_profile(), requests(tmp_path), {"trace": SLO(1.0, 0.03)}, 2)
    one = ev.goodput(Topology.parse("colocated:1d"))
    two = ev.goodput(Topology.parse("colocated:2d"))
    assert 0 < one.goodput < two.goodput
    assert (one.at_rate["all"].slo_attainment or 0) >= 0.9
    assert two.per_node == pytest.approx(two.goodput / 2)


def test_goodput_is_zero_when_even_the_lowest_rate_misses(tmp_path):
    ev = Evaluator(simple_profile(), requests(tmp_path, 10), {"trace": SLO(1e-4, 1.0)}, 0)
    assert ev.goodput(Topology.parse("colocated:1d")).goodput == 0


def test_every_class_must_meet_its_slo_when_asked(tmp_path):
    """Two classes, one with an SLO nobody meets: together 90% may still pass, but not each."""
    lines = [
        f'{{"arrival_s": {i}, "prompt_tokens": 32, "output_tokens": 24, "class": "{c}"}}'
        for i, c in enumerate(["easy"] * 19 + ["hard"] * 1)
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    reqs = options.Requests(argparse.Namespace(trace=str(tmp_path / "t.jsonl"), workload="chat",
                                               num_requests=0, seed=0))  # fmt: skip
    slo = {"easy": SLO(1.0, 0.1), "hard": SLO(1e-4, 0.1)}
    together = Evaluator(simple_profile(), reqs, slo, 0).goodput(Topology.parse("colocated:1d"))
    each = Evaluator(simple_profile(), reqs, slo, 0, every_class=True)
    assert together.goodput > 0 and each.goodput(Topology.parse("colocated:1d")).goodput == 0


def test_plan_prints_the_best_topologies_ranked_per_node(tmp_path, capsys):
    path = tmp_path / "profile.json"
    simple_profile().save(path)
    argv = ["--profile", str(path), "--nodes", "2", "--trace", small_trace(tmp_path / "t.jsonl"),
            "--slo", "trace=1000:30", "--modes", "colocated,disaggregated"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[2].strip() for r in rows] and len(rows) == 2
    assert {r.split("|")[2].strip() for r in rows} == {"colocated:2d", "disaggregated:1p1d"}
    assert "trace: TTFT <= 1000 ms, TPOT <= 30 ms" in out


@pytest.mark.parametrize("modes", ["disaggregated", "colocated"])
def test_plan_writes_the_best_topology_out_as_settings_a_cluster_and_an_overlay(
    tmp_path, capsys, modes
):
    """The written files run what was chosen: serve.toml loads as settings with its mode,
    cluster.sh starts its servers, and the overlay renders (kubectl kustomize) with the
    pools' replicas, HPA floors at the plan, and the same settings in every pod."""
    import shutil
    import subprocess

    import yaml

    from disagg.settings import ServeSettings

    path = tmp_path / "profile.json"
    simple_profile().save(path)
    out = tmp_path / "plan"
    argv = ["--profile", str(path), "--nodes", "3", "--trace", small_trace(tmp_path / "t.jsonl"),
            "--slo", "trace=1000:30", "--modes", modes, "--write", str(out),
            "--max-num-seqs", "8"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    first = [r for r in printed.splitlines() if r.startswith("| 1 |")][0]
    name = first.split("|")[2].strip()
    chosen = Topology.parse(name)
    s = ServeSettings.load(out / "serve.toml", env={})
    assert (s.mode, s.decode_max_num_seqs) == (modes, 8)
    assert name in (out / "serve.toml").read_text().splitlines()[0]
    sh = (out / "cluster.sh").read_text()
    assert f"--prefill {chosen.num_prefill} --decode {chosen.num_decode}" in sh
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the written overlay was NOT rendered")
    rendered = subprocess.run([kubectl, "kustomize", str(out)], capture_output=True, text=True,
                              timeout=60, check=True).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert deps["disagg-prefill"]["spec"]["replicas"] == chosen.num_prefill
    assert deps["disagg-decode"]["spec"]["replicas"] == chosen.num_decode
    for dep in deps.values():
        env = {
            e["name"]: e.get("value")
            for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env["DISAGG_MODE"] == modes and env["DISAGG_DECODE_MAX_NUM_SEQS"] == "8"
    hpas = {d["metadata"]["name"]: d for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    assert hpas["disagg-decode"]["spec"]["minReplicas"] == chosen.num_decode
    if chosen.num_prefill:
        assert hpas["disagg-prefill"]["spec"]["minReplicas"] == chosen.num_prefill
    else:
        assert "disagg-prefill" not in hpas
