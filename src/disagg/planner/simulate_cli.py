"""`disagg simulate`: predict what topologies serve a workload at given rates, from a
profile, in simulated time (seconds of computing, no model): the tables `disagg bench`
prints for a measurement, for a prediction.

    disagg simulate --topology colocated:2d --topology disaggregated:1p1d \\
        --workload interference --rates 0.1,0.2,0.4

Topologies: `<mode>:<P>p<D>d[@shared]` (planner/topology.py). SLOs: --slo per class, or
calibrated as bench's are (factors times the best topology's unloaded p50). Writes each
predicted sweep as JSON (the shape of a measured one, with "predicted": true).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from disagg.bench import report as R
from disagg.bench.cli import DEFAULT_RATES
from disagg.bench.sweep import Sweep, SweepConfig
from disagg.errors import ConfigError
from disagg.planner import options
from disagg.planner.profile import Profile
from disagg.planner.sweep import simulate_sweep
from disagg.planner.topology import Topology


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disagg simulate", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument(
        "--topology", action="append", default=[], metavar="MODE:PpDd[@shared]",
        help="repeatable (default: colocated:2d, disaggregated:1p1d, conditional:1p1d)",
    )  # fmt: skip
    p.add_argument("--rates", help="comma-separated req/s (default: the workload's bench rates)")
    options.add_workload(p)
    options.add_engine(p)
    p.add_argument("--out-dir", default="results/simulated", help="predicted sweeps (JSON)")
    return p


def utilisation_line(sweep: Sweep) -> str:
    """Each node's busy share at each rate: the decode-utilisation signal."""
    parts = []
    for rate, nodes in sweep.get("utilisation", {}).items():
        busy = ", ".join(f"{n} {100 * u:.0f}%" for n, u in nodes.items())
        parts.append(f"@{float(rate):g}/s: {busy}")
    return f"{sweep['label']} busy: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        profile = Profile.load(a.profile)
        specs = a.topology or ["colocated:2d", "disaggregated:1p1d", "conditional:1p1d"]
        topologies = [Topology.parse(t, **options.engine_options(a)) for t in specs]
        requests = options.Requests(a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rates = tuple(float(r) for r in a.rates.split(",")) if a.rates else DEFAULT_RATES.get(
        a.workload, (0.2, 0.4, 0.8)
    )  # fmt: skip
    if requests.trace is not None and not a.rates:
        rates = ()  # the trace's own arrival times
    cfg = SweepConfig(a.workload, rates, a.num_requests, a.warmup, seed=a.seed)
    sweeps: dict[str, Sweep] = {}
    for t in topologies:
        print(f"simulating {t.name} ...", file=sys.stderr)
        if requests.trace is not None and rates:
            sweeps[t.name] = _trace_at_rates(profile, t, cfg, requests)
        else:
            sweeps[t.name] = simulate_sweep(profile, t, cfg, trace=requests.trace)
    slo = R.slos(list(sweeps.values()), a.ttft_factor, a.tpot_factor, options.overrides(a))
    results = {name: R.summarize_sweep(s, slo) for name, s in sweeps.items()}
    print(f"Predicted from {a.profile}: {profile.describe().splitlines()[0]}\n")
    print(R.markdown_table(requests.name, results, slo))
    print(R.detail_table(results))
    for s in sweeps.values():
        print(utilisation_line(s))
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, s in sweeps.items():
        stem = f"{a.workload if requests.trace is None else 'trace'}-{name.replace(':', '-')}"
        (out / f"{stem}.json").write_text(json.dumps(s))
    print(f"wrote {len(sweeps)} predicted sweeps to {out}/")
    return 0


def _trace_at_rates(
    profile: Profile, t: Topology, cfg: SweepConfig, requests: options.Requests
) -> Sweep:
    """A trace replayed at each of cfg.rates (its arrival times scaled), as one sweep."""
    merged: Sweep | None = None
    for rate in cfg.rates:
        one = simulate_sweep(profile, t, cfg, trace=requests.at(rate))
        if merged is None:
            merged = one
            merged["rates"], merged["utilisation"] = {}, {}
        (key,) = one["rates"]
        merged["rates"][str(rate)] = one["rates"][key]
        merged["utilisation"][str(rate)] = one["utilisation"][key]
    assert merged is not None
    return merged
