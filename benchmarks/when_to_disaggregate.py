#!/usr/bin/env python3
"""When does disaggregation beat co-location, from how many nodes, at which ratio? (issue 26
item 4, the article's question), answered by `disagg plan`'s search over a profile.

For each workload and each node count N (1..--max-nodes), the goodput per node of
co-location (N decode nodes, each prefilling its own requests) against the best
disaggregated split P prefill + D decode (P + D = N; and conditional with --conditional),
each searched as `disagg plan` does (simulated runs, the highest rate at which 90% of the
requests meet the SLO). One SLO per workload for every N: bench's factors times the best
unloaded p50 of the two-node candidates (`--slo CLASS=TTFT_MS:TPOT_MS` to fix it).

These are predictions from a profile (planner/simulator.py), not measurements; where the
profile comes from, and what the simulator leaves out, are in docs/planner.md.

    python benchmarks/when_to_disaggregate.py --profile results/profile-1t.json \\
        [--workloads chat,interference,prefill-heavy,decode-heavy,mixed] [--max-nodes 8]
Prints a table; writes results/when_to_disaggregate.json and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from disagg.contracts import COLOCATED, CONDITIONAL, DISAGGREGATED
from disagg.planner import options
from disagg.planner.plan import Candidate, Evaluator, calibrated_slo, topologies
from disagg.planner.profile import Profile

ROOT = Path(__file__).resolve().parents[1]


def search(ev: Evaluator, n: int, modes: tuple[str, ...], engine: dict) -> list[Candidate]:
    return [ev.goodput(t) for t in topologies(n, modes, **engine)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--workloads", default="chat,interference,prefill-heavy,decode-heavy,mixed")
    p.add_argument("--max-nodes", type=int, default=8)
    p.add_argument("--conditional", action="store_true", help="also search conditional splits")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--ttft-factor", type=float, default=5.0)
    p.add_argument("--tpot-factor", type=float, default=3.0)
    p.add_argument("--slo", action="append", default=[], help="CLASS=TTFT_MS:TPOT_MS")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "when_to_disaggregate.json")
    options.add_engine(p)
    a = p.parse_args(argv)
    profile = Profile.load(a.profile)
    engine = options.engine_options(a)
    modes = (DISAGGREGATED, CONDITIONAL) if a.conditional else (DISAGGREGATED,)
    rows = []
    started = time.monotonic()
    for workload in [w for w in a.workloads.split(",") if w]:
        ns = argparse.Namespace(trace=None, workload=workload, num_requests=a.num_requests,
                                seed=a.seed, slo=a.slo)  # fmt: skip
        ev = Evaluator(profile, options.Requests(ns), {}, a.warmup)
        two = list(topologies(2, (COLOCATED, *modes), **engine))
        ev.slo = calibrated_slo(ev, two, a.ttft_factor, a.tpot_factor, options.overrides(ns))
        for n in range(1, a.max_nodes + 1):
            colo = search(ev, n, (COLOCATED,), engine)[0]
            split = search(ev, n, modes, engine) if n > 1 else []
            best = max(split, key=lambda c: c.per_node, default=None)
            rows.append({
                "workload": workload, "nodes": n,
                "colocated_per_node": colo.per_node,
                "best_split": best.topology.name if best else None,
                "split_per_node": best.per_node if best else None,
                "splits": {c.topology.name: c.per_node for c in split},
                "slo": {c: [s.ttft_s, s.tpot_s] for c, s in ev.slo.items()},
            })  # fmt: skip
            r = rows[-1]
            print(f"[{time.monotonic() - started:6.0f} s] {workload} N={n}: colocated "
                  f"{colo.per_node:.3g}/node, best split {r['best_split']} "
                  f"{r['split_per_node'] or 0:.3g}/node", file=sys.stderr, flush=True)  # fmt: skip
    print(table(rows))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"profile": a.profile, "machine": profile.describe().splitlines()[0],
            "num_requests": a.num_requests, "engine": engine}  # fmt: skip
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, a.out.with_suffix(".png"), meta["machine"])
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| workload | nodes | colocated req/s per node | best split | its req/s per node | "
             "split / colocated |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        split = r["split_per_node"]
        ratio = (
            f"{split / r['colocated_per_node']:.2f}x" if split and r["colocated_per_node"] else "-"
        )
        lines.append(f"| {r['workload']} | {r['nodes']} | {r['colocated_per_node']:.3g} | "
                     f"{r['best_split'] or '-'} | {split or 0:.3g} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.6), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        mine = [r for r in rows if r["workload"] == w]
        ax.plot([r["nodes"] for r in mine], [r["colocated_per_node"] for r in mine], "o-",
                label="colocated")  # fmt: skip
        split = [r for r in mine if r["split_per_node"] is not None]
        ax.plot([r["nodes"] for r in split], [r["split_per_node"] for r in split], "s-",
                label="best P:D split")  # fmt: skip
        for r in split:
            where = (r["nodes"], r["split_per_node"])
            ax.annotate(r["best_split"].split(":")[1], where, fontsize=7,
                        textcoords="offset points", xytext=(0, 5), ha="center")  # fmt: skip
        ax.set_title(w)
        ax.set_xlabel("nodes")
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("goodput per node (req/s, predicted)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"When disaggregation pays (simulated from a profile: {machine})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
