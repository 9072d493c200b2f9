"""The loaded calibration (planner/calibrate.py) from plain numbers: a hand-made profile, a
"measured" sweep simulated with known costs, and the fit that must find them again."""

from __future__ import annotations

import math

import pytest
from helpers.profiles import simple_profile

from disagg.bench.sweep import SweepConfig
from disagg.planner.calibrate import carried, fit_loaded, log_errors, served_step_s, shifted
from disagg.planner.costs import DecodeCost, PiecewiseLinear
from disagg.planner.profile import Profile
from disagg.planner.sweep import simulate_sweep
from disagg.planner.topology import Topology

pytestmark = pytest.mark.unit
P = simple_profile().with_overheads(step_s=0.004)
CFG = SweepConfig("chat", (2.0, 6.0), num_requests=24, warmup=2)
SHARED = Topology.parse("conditional:1p1d@shared")


def test_shifting_the_cost_to_responses_leaves_an_unloaded_step_as_it_was():
    s = shifted(P, 0.003, 2.0)
    o = s.overheads
    assert (o.send_s, o.contention) == (0.003, 2.0)
    assert math.isclose(o.send_s + o.step_s, P.overheads.send_s + P.overheads.step_s)
    assert shifted(P, 0.05, 1.0).overheads.step_s == 0.0  # never below nothing


def test_the_profile_carries_its_contention_and_a_topology_may_override_it(tmp_path):
    path = tmp_path / "p.json"
    shifted(P, 0.001, 2.5).save(path)
    loaded = Profile.load(path)
    assert loaded.overheads.contention == 2.5
    harsh = simulate_sweep(loaded, SHARED, CFG)
    fair = simulate_sweep(loaded.with_overheads(contention=1.0), SHARED, CFG)
    fair_topology = Topology.parse("conditional:1p1d@shared", contention=1.0)
    override = simulate_sweep(loaded, fair_topology, CFG)
    assert override["rates"] == fair["rates"]
    assert harsh["rates"] != fair["rates"]
    assert log_errors(fair, fair) == [0.0] * len(log_errors(fair, fair))
    assert max(log_errors(fair, harsh)) > 0.01  # pools that slow each other more: slower


def test_the_fit_finds_the_costs_a_run_was_made_with():
    truth = shifted(P, 0.002, 2.0)
    measured = [simulate_sweep(truth, SHARED, CFG), simulate_sweep(truth, Topology.parse(
        "colocated:1d@shared"), CFG)]  # fmt: skip
    topologies = [SHARED, Topology.parse("colocated:1d@shared")]
    calls = []
    fit = fit_loaded(
        P, measured, lambda p, i: simulate_sweep(p, topologies[i], CFG),
        sends=(0.0, 0.001, 0.002, 0.003), contentions=(1.0, 2.0, 3.0),
        progress=lambda: calls.append(1),
    )  # fmt: skip
    assert (fit.send_s, fit.contention) == (0.002, 2.0)
    assert fit.error < 1e-9
    assert fit.profile.overheads == truth.overheads
    assert len(calls) == 12


def test_a_fit_needs_a_run():
    with pytest.raises(ValueError):
        fit_loaded(P, [], lambda p, i: {})


def test_a_fit_carried_to_another_machine_keeps_its_share_of_a_step_not_its_seconds():
    # a machine half as fast a step: decode 20 ms for one row, 10 ms a step outside it
    slow = simple_profile(
        decode=DecodeCost(
            PiecewiseLinear((1.0, 9.0), (0.020, 0.036)), PiecewiseLinear((1.0,), (0.0,))
        )
    ).with_overheads(step_s=0.010)
    fit = shifted(slow, 0.004, 3.0)  # what --fit-loaded found there
    assert math.isclose(served_step_s(fit), 0.020 + 0.010 + 0.0001)  # unloaded: unchanged
    moved = carried(fit, P)
    o = moved.overheads
    assert o.contention == 3.0
    assert math.isclose(o.send_s, 0.004 * (0.010 + 0.004 + 0.0001) / 0.0301)
    assert math.isclose(served_step_s(moved), served_step_s(P))  # P's unloaded step kept
    # carried back onto the profile it was fitted from, a fit is itself
    assert math.isclose(carried(fit, slow).overheads.send_s, 0.004)
    assert math.isclose(carried(fit, slow).overheads.step_s, fit.overheads.step_s)
