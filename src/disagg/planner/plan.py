"""`disagg plan`: given a workload, SLOs and N nodes of a profiled kind, search the
topologies and print the best few by predicted goodput per node.

    disagg plan --profile results/profile.json --nodes 4 --workload mixed \\
        --slo critical=800:60 --slo standard=3000:80 [--write plans/mixed-4]

Candidates with N nodes: colocated with N decode nodes, and for disaggregated and
conditional every split P prefill + D decode (P, D >= 1, P + D = N); `--max-nodes` also
tries every smaller N, so a topology that needs fewer nodes can win per node. A topology's
goodput is the highest offered rate at which at least 90% of the measured requests meet
their class's SLO (bench/stats.py's definition), found by doubling the rate until the
target is missed and then bisecting; each rate is one simulated run (after the unloaded
calibration requests, which warm the conditional cost model as a real sweep's do).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.bench import report as R
from disagg.bench.stats import SLO, ClassSummary, measured, summarize
from disagg.bench.sweep import calibration_specs
from disagg.contracts import COLOCATED, MODES
from disagg.errors import ConfigError
from disagg.planner import options, write_out
from disagg.planner.profile import Profile
from disagg.planner.simulator import Simulator, cost_model_for
from disagg.planner.sweep import trace_calibration
from disagg.planner.topology import Topology

TARGET = R.TARGET_ATTAINMENT


@dataclass(frozen=True)
class Candidate:
    topology: Topology
    goodput: float  # req/s: the highest rate meeting the target (0: not even the lowest)
    at_rate: dict[str, ClassSummary]  # class or "all" -> statistics at that rate

    @property
    def per_node(self) -> float:
        return self.goodput / self.topology.num_nodes


def topologies(num_nodes: int, modes: tuple[str, ...], **engine: Any) -> Iterator[Topology]:
    for mode in modes:
        if mode == COLOCATED:
            yield Topology(mode, 0, num_nodes, **engine)
            continue
        for p in range(1, num_nodes):
            yield Topology(mode, p, num_nodes - p, **engine)


class Evaluator:
    """Attainment of one topology at one rate, by simulation."""

    def __init__(
        self, profile: Profile, requests: options.Requests, slo: dict[str, SLO], warmup: int,
        every_class: bool = False,
    ) -> None:  # fmt: skip
        """`every_class`: a rate counts only when each class meets the target on its own
        (else, as bench counts goodput, when all requests together do)."""
        self.profile, self.requests, self.slo, self.warmup = profile, requests, slo, warmup
        self.every_class = every_class

    def meets(self, stats: dict[str, ClassSummary]) -> bool:
        names = self.requests.classes if self.every_class else ["all"]
        return all((stats[c].slo_attainment or 0) >= TARGET for c in names)

    def calibration(self) -> list[Any]:
        if self.requests.trace is not None:
            return trace_calibration(self.requests.trace, 3)
        return calibration_specs(self.requests.workload, 3, self.requests.seed)

    def at(self, topology: Topology, rate: float) -> dict[str, ClassSummary]:
        cost = cost_model_for(topology)
        Simulator(self.profile, topology, cost).run_one_at_a_time(self.calibration())
        result = Simulator(self.profile, topology, cost).run(self.requests.at(rate))
        ts = measured(result.timelines, self.warmup)
        return {c: summarize(ts, c, self.slo) for c in [*self.requests.classes, "all"]}

    def goodput(
        self, topology: Topology, start: float = 0.05, steps: int = 6, top: float = 1e3
    ) -> Candidate:
        """Double from `start` until the target is missed, then bisect `steps` times."""
        ok_rate, ok_stats, rate = 0.0, self.at(topology, start), start
        stats = ok_stats
        while self.meets(stats) and rate < top:
            ok_rate, ok_stats = rate, stats
            rate *= 2
            stats = self.at(topology, rate)
        lo, hi = ok_rate, rate
        for _ in range(steps):
            mid = (lo + hi) / 2
            stats = self.at(topology, mid)
            if self.meets(stats):
                lo, ok_stats = mid, stats
            else:
                hi = mid
        return Candidate(topology, lo, ok_stats)


def calibrated_slo(
    ev: Evaluator, candidates: list[Topology], ttft_factor: float, tpot_factor: float,
    given: dict[str, SLO],
) -> dict[str, SLO]:  # fmt: skip
    """Per class not given: the factors times the lowest unloaded p50 among the candidates
    (as bench report.slos does across modes)."""
    from dataclasses import asdict

    sweeps = []
    for t in candidates:
        unloaded = Simulator(ev.profile, t).run_one_at_a_time(ev.calibration())
        sweeps.append({"unloaded": [asdict(x) for x in unloaded.timelines]})
    return R.slos(sweeps, ttft_factor, tpot_factor, given)


def table(best: list[Candidate], classes: list[str]) -> str:
    head = (
        "| rank | topology | nodes | goodput req/s | per node | "
        + " | ".join(f"{c} SLO met" for c in classes)
        + " | TTFT p50/p90 ms | TPOT p50 ms |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, c in enumerate(best, 1):
        a = c.at_rate["all"]
        met = " | ".join(f"{100 * (c.at_rate[k].slo_attainment or 0):.0f}%" for k in classes)
        lines.append(
            f"| {i} | {c.topology.name} | {c.topology.num_nodes} | {c.goodput:.3g} | "
            f"{c.per_node:.3g} | {met} | {a.ttft.p50 * 1e3:.0f} / {a.ttft.p90 * 1e3:.0f} | "
            f"{a.tpot.p50 * 1e3:.0f} |"
        )
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disagg plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, required=True, help="nodes of the profiled kind")
    p.add_argument("--max-nodes", action="store_true", help="also try every smaller count")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated serving modes")
    p.add_argument("--top", type=int, default=5, help="how many to print")
    p.add_argument(
        "--every-class", action="store_true",
        help="a rate counts only when each class meets its SLO (default: all requests together)",
    )  # fmt: skip
    p.add_argument(
        "--write", type=Path, default=None, metavar="DIR",
        help="write the best topology out: serve.toml, cluster.sh, kustomization.yaml",
    )  # fmt: skip
    p.add_argument("--overlay", choices=("cpu", "gpu"), default="cpu",
                   help="the Kubernetes overlay the written one builds on")  # fmt: skip
    options.add_workload(p)
    options.add_engine(p)
    p.set_defaults(num_requests=120)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        profile = Profile.load(a.profile)
        requests = options.Requests(a)
        modes = tuple(m for m in a.modes.split(",") if m)
        counts = range(1, a.nodes + 1) if a.max_nodes else (a.nodes,)
        engine = options.engine_options(a)
        candidates = [t for n in counts for t in topologies(n, modes, **engine)]
        if a.write is not None:  # now, not after a search of minutes
            a.write.mkdir(parents=True, exist_ok=True)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not candidates:
        print("error: no topology fits (disaggregated needs at least 2 nodes)", file=sys.stderr)
        return 2
    ev = Evaluator(profile, requests, {}, a.warmup, a.every_class)
    ev.slo = calibrated_slo(ev, candidates, a.ttft_factor, a.tpot_factor, options.overrides(a))
    results = []
    for t in candidates:
        print(f"searching {t.name} ...", file=sys.stderr)
        results.append(ev.goodput(t))
    best = sorted(results, key=lambda c: (-c.per_node, -c.goodput, c.topology.num_nodes))
    slo_text = ", ".join(f"{c}: TTFT <= {s.ttft_s * 1e3:.0f} ms, TPOT <= {s.tpot_s * 1e3:.0f} ms"
                         for c, s in ev.slo.items())  # fmt: skip
    print(f"{requests.name} on up to {a.nodes} nodes; SLO {slo_text}; profile: "
          f"{profile.describe().splitlines()[0]}\n")  # fmt: skip
    print(table(best[: a.top], requests.classes))
    if a.write is not None:
        top = best[0]
        why = (
            f"disagg plan: {write_out.describe(top.topology)}; predicted goodput "
            f"{top.goodput:.3g} req/s ({top.per_node:.3g} per node) for {requests.name}; "
            f"SLO {slo_text}"
        )
        for path in write_out.write(top.topology, a.write, why, a.overlay):
            print(f"wrote {path}")
        if top.goodput == 0:
            print("warning: the written topology met the SLO at no rate tried (goodput 0)")
    if any(c.goodput == 0 for c in best[: a.top]):
        print("goodput 0: fewer than 90% met the SLO even at the lowest rate tried, where "
              "requests barely overlap: the SLO is tighter than these nodes serve the "
              "workload's longer requests alone (see the SLO met columns)")  # fmt: skip
    return 0
