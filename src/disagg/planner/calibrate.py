"""A profile fitted to a loaded run: the two costs a profile taken in one process cannot see.

`disagg profile` times the engine alone. Served under load, two more things cost time
(docs/benchmarks.md "Served against the engine"), and both grow with the load:

- each response the serving path carries (tritonserver, the BLS stubs, the gateway, the
  client) takes CPU the engine's threads wanted: `overheads.send_s`, charged per response;
- two processes splitting their work among the same cores (a prefill pool beside decode on
  one server) slow each other more than fair sharing says: `overheads.contention`.

Unloaded, a step sends one response, so the unloaded calibration (benchmarks/sim_vs_real.py)
cannot tell a cost per response from one per step and puts it all in `step_s`. This fit
searches a grid of (send_s, contention), moving into `send_s` what it takes out of `step_s`
(the unloaded requests stay fitted), and keeps the pair whose predictions of the loaded
rates' TTFT p50/p90 and TPOT p50 are closest to the measured, by the mean |log(predicted /
measured)|. Fitted on one run, it is checked on another (sim_vs_real --measured).

Carried to another machine (`carried`), a fit keeps its contention and its cost per
response as a share of an unloaded served step, not in seconds: four runs on two CPUs
fitted 0.11-0.15 of a step where the seconds differed 2x (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from disagg.bench import report as R
from disagg.bench.sweep import Sweep
from disagg.planner.profile import Profile

SEND_GRID_S = tuple(i * 0.0005 for i in range(13))  # 0 .. 6 ms a response
CONTENTION_GRID = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)
STEP_POSITIONS = 256  # a chat turn's context, where `carried` compares steps
FIELDS = (("ttft", "p50"), ("ttft", "p90"), ("tpot", "p50"))

Simulate = Callable[[Profile, int], Sweep]  # (profile, index of the measured sweep) -> predicted


@dataclass(frozen=True)
class Fit:
    send_s: float
    contention: float
    error: float  # mean |log(predicted / measured)| over the loaded rates' checked figures
    profile: Profile


def shifted(profile: Profile, send_s: float, contention: float) -> Profile:
    """`profile` with `send_s` a response and `contention`, and `step_s` lowered by what
    `send_s` adds to an unloaded step (one response), so unloaded requests cost the same."""
    o = profile.overheads
    step_s = max(o.step_s + o.send_s - send_s, 0.0)
    return profile.with_overheads(send_s=send_s, step_s=step_s, contention=contention)


def served_step_s(profile: Profile, positions: int = STEP_POSITIONS) -> float:
    """An unloaded served decode step as `profile` predicts it: one sequence's engine step
    at `positions`, plus what a step and its one response cost outside the engine."""
    o = profile.overheads
    return profile.decode(1, positions) + o.step_s + o.send_s


def carried(fitted: Profile, onto: Profile) -> Profile:
    """`onto` (calibrated on another run, maybe another machine) with `fitted`'s loaded fit:
    its contention, and its cost per response scaled by the two profiles' unloaded served
    steps (a path twice as fast per step costs half as much per response)."""
    share = fitted.overheads.send_s / served_step_s(fitted)
    return shifted(onto, share * served_step_s(onto), fitted.overheads.contention)


def log_errors(measured: Sweep, predicted: Sweep) -> list[float]:
    """|log(predicted / measured)| of TTFT p50, p90 and TPOT p50 at every loaded rate (all
    classes together), leaving out figures either side lacks."""
    slo = R.slos([measured], 3.0, 2.0)
    meas, pred = R.summarize_sweep(measured, slo), R.summarize_sweep(predicted, slo)
    out = []
    for rate, by_class in meas["by_rate"].items():
        m, p = by_class["all"], pred["by_rate"][rate]["all"]
        for dist, field in FIELDS:
            mv, pv = getattr(getattr(m, dist), field), getattr(getattr(p, dist), field)
            if mv > 0 and pv > 0 and not (math.isnan(mv) or math.isnan(pv)):
                out.append(abs(math.log(pv / mv)))
    return out


def fit_loaded(
    profile: Profile,
    measured: Sequence[Sweep],
    simulate: Simulate,
    sends: Sequence[float] = SEND_GRID_S,
    contentions: Sequence[float] = CONTENTION_GRID,
    progress: Callable[[], None] = lambda: None,
) -> Fit:
    """The grid point that predicts `measured` (each simulated by `simulate(profile, i)`)
    best; ties go to the smaller send_s, then the smaller contention."""
    if not measured:
        raise ValueError("no measured sweeps to fit")
    best: Fit | None = None
    for send_s in sends:
        for contention in contentions:
            candidate = shifted(profile, send_s, contention)
            errors: list[float] = []
            for i, sweep in enumerate(measured):
                errors += log_errors(sweep, simulate(candidate, i))
            progress()
            error = sum(errors) / len(errors) if errors else math.inf
            if best is None or error < best.error - 1e-12:
                best = Fit(send_s, contention, error, candidate)
    assert best is not None
    return best
