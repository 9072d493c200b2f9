"""A simulated rate sweep, in the shape of bench/sweep.py's real one (the same seeded
requests: unloaded calibration one at a time, then each rate open loop), so that
bench/report.py gives a prediction the tables, SLOs and goodput a measurement gets.

Traces: a JSON-lines or CSV file of requests, one a line, with `arrival_s`,
`prompt_tokens`, `output_tokens` and optionally `class` (default "trace"). A trace is one
"rate" of a sweep: its mean arrival rate, its own arrival times.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from disagg.bench import workloads as W
from disagg.bench.sweep import Sweep, SweepConfig, calibration_specs
from disagg.errors import ConfigError
from disagg.planner.profile import Profile
from disagg.planner.simulator import SimResult, Simulator, cost_model_for
from disagg.planner.topology import Topology

TRACE_CLASS = "trace"


def load_trace(path: str | Path) -> list[W.RequestSpec]:
    """Requests from a trace file (see the module docstring), sorted by arrival."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace {path} not found")
    text = path.read_text()
    if path.suffix == ".csv":
        rows: list[dict[str, Any]] = list(csv.DictReader(text.splitlines()))
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    specs = []
    for i, row in enumerate(rows):
        try:
            specs.append(W.RequestSpec(
                index=i, cls=str(row.get("class") or TRACE_CLASS),
                arrival_s=float(row["arrival_s"]), prompt_tokens=int(row["prompt_tokens"]),
                max_tokens=int(row["output_tokens"]), hints={},
            ))  # fmt: skip
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{path} line {i + 1}: need arrival_s, prompt_tokens, "
                              f"output_tokens ({e!r})") from e  # fmt: skip
    if not specs:
        raise ConfigError(f"trace {path} holds no requests")
    specs.sort(key=lambda s: s.arrival_s)
    start = specs[0].arrival_s
    return [replace(s, index=i, arrival_s=s.arrival_s - start) for i, s in enumerate(specs)]


def trace_rate(specs: list[W.RequestSpec]) -> float:
    span = specs[-1].arrival_s - specs[0].arrival_s
    return (len(specs) - 1) / span if span > 0 else float(len(specs))


def trace_calibration(specs: list[W.RequestSpec], per_class: int) -> list[W.RequestSpec]:
    """The first `per_class` requests of each class, outputs capped as bench's calibration."""
    from disagg.bench.sweep import CALIBRATION_MAX_TOKENS

    chosen: list[W.RequestSpec] = []
    for cls in sorted({s.cls for s in specs}):
        chosen += [s for s in specs if s.cls == cls][:per_class]
    return [replace(s, max_tokens=min(s.max_tokens, CALIBRATION_MAX_TOKENS)) for s in chosen]


def _timelines(result: SimResult) -> list[dict[str, Any]]:
    return [asdict(t) for t in result.timelines]


def simulate_sweep(
    profile: Profile,
    topology: Topology,
    cfg: SweepConfig,
    label: str = "",
    trace: list[W.RequestSpec] | None = None,
) -> Sweep:
    """bench/sweep.py's sweep, predicted: a Sweep dict report.py reads, plus what the
    simulator counted ("server": decisions and who prefilled, as the real servers count;
    "utilisation": each node's busy share per rate)."""
    label = label or topology.name
    cost = cost_model_for(topology)  # learns across the sweep, as the server's does
    if trace is None:
        workload = W.WORKLOADS[cfg.workload]
        unloaded_specs = calibration_specs(workload, cfg.calibration_per_class, cfg.seed)
        runs = {str(r): W.build(workload, r, cfg.num_requests, cfg.seed) for r in cfg.rates}
    else:
        unloaded_specs = trace_calibration(trace, cfg.calibration_per_class)
        runs = {str(round(trace_rate(trace), 4)): trace}
    out: Sweep = {
        "config": asdict(cfg), "label": label, "topology": topology.as_dict(),
        "predicted": True, "profile": profile.machine, "rates": {}, "utilisation": {},
    }  # fmt: skip
    unloaded = Simulator(profile, topology, cost).run_one_at_a_time(unloaded_specs)
    out["unloaded"] = _timelines(unloaded)
    counts: dict[str, float] = dict(unloaded.counts)
    for rate, specs in runs.items():
        result = Simulator(profile, topology, cost).run(specs)
        out["rates"][rate] = _timelines(result)
        out["utilisation"][rate] = result.utilisation
        for k, v in result.counts.items():
            counts[k] = counts.get(k, 0.0) + v
    out["server"] = counts
    return out
