"""How much a rerun moves a sweep's percentiles: two measured runs of the same seeded sweeps
side by side (the saved sweeps `disagg bench compare` and `sim_vs_real.py` write), and, from
each run alone, a bootstrap of its requests: how far the percentile would move if the same
number of requests were drawn again, and how many requests per rate would keep a rerun
within 5 points (issue 26: "enough requests per rate that a rerun moves percentages by less
than 5 points").

    python benchmarks/rerun_spread.py results/svr_b/measured results/svr_c/measured

The bootstrap treats requests as independent. Under load they are not (a queue couples
neighbours), and the machine's own speed drifts between runs, so the two runs' difference is
the figure to trust; the bootstrap says how much of it is the sample size alone. Writes
<out>/rerun_spread.{md,json}."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from disagg.bench.stats import Timeline, bootstrap_sd, measured, rerun_needs

TARGET_POINTS = 5.0  # a rerun within this many percent, with 90% probability
METRICS = (("TTFT p50", "ttft", 50), ("TTFT p90", "ttft", 90), ("TPOT p50", "tpot", 50))


def values(sweep: dict[str, Any], rate: str, field: str) -> np.ndarray:
    """Per request of the rate, after warm-up: its TTFT or TPOT (seconds)."""
    ts = [Timeline(**t) for t in sweep["rates"][rate]]
    ok = [t for t in measured(ts, sweep["config"]["warmup"]) if t.ok]
    got = [t.ttft if field == "ttft" else t.tpot for t in ok]
    return np.asarray([v for v in got if v is not None], float)


def rows(a: dict[str, Any], b: dict[str, Any], rng: np.random.Generator) -> list[dict[str, Any]]:
    out = []
    for rate in sorted(a["rates"], key=float):
        if rate not in b["rates"]:
            continue
        for label, field, q in METRICS:
            xa, xb = values(a, rate, field), values(b, rate, field)
            pa, pb = (float(np.percentile(x, q)) if len(x) else math.nan for x in (xa, xb))
            sd = max(bootstrap_sd(xa, q, rng), bootstrap_sd(xb, q, rng))
            out.append({
                "rate": float(rate), "metric": label, "n": min(len(xa), len(xb)),
                "run_a_ms": 1e3 * pa, "run_b_ms": 1e3 * pb,
                "moved_points": 100 * (pb - pa) / pa, "bootstrap_sd_points": 100 * sd,
                "n_for_5_points": rerun_needs(min(len(xa), len(xb)), sd, TARGET_POINTS),
            })  # fmt: skip
    return out


def table(name: str, got: list[dict[str, Any]]) -> str:
    head = "| rate | metric | n | run A ms | run B ms | moved | bootstrap sd | n for < 5 points |"
    lines = [f"**{name}**", "", head, "|---|---|---|---|---|---|---|---|"]
    for r in got:
        mark = "" if abs(r["moved_points"]) < TARGET_POINTS else " **x**"
        lines.append(
            f"| {r['rate']:g} | {r['metric']} | {r['n']} | {r['run_a_ms']:.0f} | "
            f"{r['run_b_ms']:.0f} | {r['moved_points']:+.1f}{mark} | "
            f"{r['bootstrap_sd_points']:.1f} | {r['n_for_5_points']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run_a", type=Path, help="a measured dir (<workload>-<mode>.json)")
    p.add_argument("run_b", type=Path)
    p.add_argument("--out", type=Path, default=Path("results/rerun_spread"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    names = sorted(f.name for f in a.run_a.glob("*.json") if (a.run_b / f.name).exists())
    if not names:
        print(f"no sweep saved in both {a.run_a} and {a.run_b}", file=sys.stderr)
        return 2
    doc, data = [f"Run A: {a.run_a}; run B: {a.run_b}.\n"], {}
    for name in names:
        sweeps = [json.loads((d / name).read_text()) for d in (a.run_a, a.run_b)]
        data[name] = got = rows(*sweeps, rng)
        doc.append(table(name.removesuffix(".json"), got))
        print(f"{name}: {sum(abs(r['moved_points']) < TARGET_POINTS for r in got)} of {len(got)} "
              f"percentiles moved by < {TARGET_POINTS:g} points")  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "rerun_spread.md").write_text(text := "\n".join(doc))
    (a.out / "rerun_spread.json").write_text(json.dumps(data, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
