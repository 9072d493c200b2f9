"""Command-line options `disagg simulate` and `disagg plan` share: the workload (a bench
workload or a trace), the SLOs, and the engine limits every replica runs with."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from disagg.bench import report as R
from disagg.bench import workloads as W
from disagg.bench.stats import SLO
from disagg.planner.sweep import load_trace, trace_rate
from disagg.planner.topology import ROUTERS, Topology


def add_workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="results/profile.json", help="from `disagg profile`")
    p.add_argument("--workload", choices=list(W.WORKLOADS), default="chat")
    p.add_argument(
        "--trace", help="JSON lines or CSV: arrival_s, prompt_tokens, output_tokens, class"
    )
    p.add_argument("--num-requests", type=int, default=200, help="per rate, warm-up included")
    p.add_argument("--warmup", type=int, default=4, help="requests left out, per rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-factor", type=float, default=3.0, help="SLO: x unloaded p50")
    p.add_argument("--tpot-factor", type=float, default=2.0, help="SLO: x unloaded p50")
    p.add_argument(
        "--slo", action="append", default=[], metavar="CLASS=TTFT_MS:TPOT_MS",
        help="a class's SLO outright instead of calibrating it (repeatable)",
    )  # fmt: skip


def add_engine(p: argparse.ArgumentParser) -> None:
    d = Topology("colocated")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="decode batch limit")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, help="decode's chunk")
    p.add_argument("--stream-interval", type=int, default=d.stream_interval)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--router", choices=ROUTERS, default=d.router, help="replica choice")
    p.add_argument(
        "--contention", type=float, default=d.contention,
        help="@shared topologies: how much pools on the same cores slow each other (0: not at "
        "all, 1: fair sharing, more: worse than fair; default: the profile's, else 1)",
    )  # fmt: skip


def engine_options(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_num_seqs": a.max_num_seqs, "prefill_chunk": a.prefill_chunk,
        "stream_interval": a.stream_interval, "max_model_len": a.max_model_len,
        "router": a.router, "contention": a.contention,
    }  # fmt: skip


def overrides(a: argparse.Namespace) -> dict[str, SLO]:
    return R.parse_slo_overrides(a.slo)


class Requests:
    """The requests of a run at a given rate: a bench workload's seeded draw, or a trace's
    own requests with its arrival times scaled to that rate."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.trace = load_trace(a.trace) if a.trace else None
        self.workload = W.WORKLOADS[a.workload]
        self.num_requests, self.seed = a.num_requests, a.seed
        self.name = f"trace {a.trace}" if a.trace else a.workload

    @property
    def classes(self) -> list[str]:
        if self.trace is not None:
            return sorted({s.cls for s in self.trace})
        return sorted(c.name for c in self.workload.classes)

    def at(self, rate: float) -> list[W.RequestSpec]:
        if self.trace is None:
            return W.build(self.workload, rate, self.num_requests, self.seed)
        scale = trace_rate(self.trace) / rate
        return [replace(s, arrival_s=s.arrival_s * scale) for s in self.trace]
