"""Command line of the benchmark harness: `disagg bench` (client/benchmark.py is the same).

run      one workload's rate sweep against a running server (Triton gRPC or the gateway)
cluster  the same on separate servers, a core per node (disagg.bench.topology)
compare  co-located vs disaggregated vs conditional: for each workload, a server per mode
         (same settings, same cores), the same seeded requests; writes results, plots and
         the docs/benchmarks.md section
report   the tables and plots again from saved results
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from disagg import contracts as C
from disagg.bench import report as R
from disagg.bench import workloads as W
from disagg.bench.sweep import Sweep, SweepConfig, run_sweep

if TYPE_CHECKING:
    from disagg.bench.runner import Target
    from disagg.serve.server import TritonServer
    from disagg.settings import ServeSettings

# `serve(base, name, out_dir)`: the server (or topology frontend) named `name`, ready
Serve = Callable[["ServeSettings", str, Path], AbstractContextManager["TritonServer"]]

MODES = (C.COLOCATED, C.DISAGGREGATED, C.CONDITIONAL)  # the order benchmarks run them
# offered rates per workload for SmolLM2-135M on 2 CPU cores: from well under capacity to past it
DEFAULT_RATES = {
    "chat": (0.2, 0.4, 0.8),
    "interference": (0.1, 0.2, 0.4),
    "prefill-heavy": (0.1, 0.2, 0.3),
    "decode-heavy": (0.25, 0.5, 1.0),
    "mixed": (0.2, 0.4, 0.8),
}
DOC_BEGIN = "<!-- serving-modes:begin (written by disagg bench compare) -->"
DOC_END = "<!-- serving-modes:end -->"


def _rates(text: str | None, workload: str) -> tuple[float, ...]:
    if not text:
        return DEFAULT_RATES[workload]
    return tuple(float(r) for r in text.split(","))


def _prompts(engine_dir: str, seed: int) -> W.PromptMaker:
    from disagg.engine.tokenizer import Tokenizer

    return W.PromptMaker(Tokenizer(engine_dir), seed)


def _target_factory(args: argparse.Namespace) -> Callable[[], Target]:
    from disagg.bench.runner import GatewayTarget, TritonTarget

    if args.target == "gateway":
        key = os.environ.get("DISAGG_API_KEY", "")
        return lambda: GatewayTarget(args.url, args.model, key)
    return lambda: TritonTarget(args.url, args.model)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = SweepConfig(
        args.workload, _rates(args.rates, args.workload), args.num_requests, args.warmup,
        seed=args.seed,
    )  # fmt: skip
    label = args.label or args.target
    sweep = run_sweep(_target_factory(args), cfg, _prompts(args.engine_dir, args.seed), label)
    sweep["command"] = _command()
    out = Path(args.out or f"results/bench-{args.workload}-{label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(sweep))
    slo = R.slos([sweep], args.ttft_factor, args.tpot_factor, R.parse_slo_overrides(args.slo))
    results = {label: R.summarize_sweep(sweep, slo)}
    print(R.markdown_table(args.workload, results, slo))
    print(R.detail_table(results))
    out.with_suffix(".summary.json").write_text(json.dumps(R.summary_json(results, slo), indent=1))
    R.plot_workload(args.workload, {label: sweep}, results, slo, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


@contextlib.contextmanager
def _mode_server(base: ServeSettings, mode: str, out_dir: Path) -> Iterator[TritonServer]:
    """One server in serving mode `mode`, ready, stopped afterwards."""
    from disagg.serve.server import TritonServer, free_ports

    http, grpc, metrics = free_ports(3)
    settings = replace(
        base, mode=mode, http_port=http, grpc_port=grpc, metrics_port=metrics,
        build_dir=str(out_dir / "triton"), gateway_enabled=False,
    )  # fmt: skip
    server = TritonServer(settings)
    server.start()
    try:
        server.wait_ready(timeout_s=300)
        yield server
    finally:
        server.stop()


def sweep_each(args: argparse.Namespace, serve: Serve, what: str) -> None:
    """For each workload and each name in args.modes: `serve(base, name, out_dir)` (a context
    manager) gives the server requests go to; one sweep against it, saved as
    <out_dir>/<workload>-<name>.json."""
    from disagg.settings import ServeSettings

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = ServeSettings.load(args.config)
    for workload in args.workloads.split(","):
        cfg = SweepConfig(
            workload, _rates(args.rates, workload), args.num_requests, args.warmup, seed=args.seed
        )
        prompts = _prompts(str(base.path("engine_dir")), args.seed)
        for name in args.modes.split(","):
            print(f"== {workload} / {name}: starting {what}", file=sys.stderr)
            with serve(base, name, out_dir) as server:
                args.url = server.endpoints.grpc
                sweep = run_sweep(_target_factory(args), cfg, prompts, name)
                sweep["server"] = _server_counts(server.endpoints.metrics)
            sweep["command"] = _command()
            (out_dir / f"{workload}-{name}.json").write_text(json.dumps(sweep))


def cmd_compare(args: argparse.Namespace) -> int:
    sweep_each(args, _mode_server, "tritonserver")
    return cmd_report(args)


def cmd_cluster(args: argparse.Namespace) -> int:
    from disagg.bench import topology

    sweep_each(args, topology.serve, "the topology")
    return cmd_report(args, markers=(topology.DOC_BEGIN, topology.DOC_END), image_prefix="topology")


def _server_counts(metrics_url: str) -> dict[str, float]:
    """What the server counted over the whole sweep: who prefilled, and the conditional
    mode's decisions by reason."""
    from disagg.status import scrape

    samples = scrape(metrics_url)
    out: dict[str, float] = {}
    for s in samples:
        if s.name == "disagg_requests_total":
            key = f"served_by={s.label('served_by')}"
        elif s.name == "disagg_conditional_decisions_total":
            key = f"{s.label('prefill')}:{s.label('reason')}"
        else:
            continue
        out[key] = out.get(key, 0.0) + s.value
    return out


def cmd_report(
    args: argparse.Namespace,
    markers: tuple[str, str] = (DOC_BEGIN, DOC_END),
    image_prefix: str = "modes",
) -> int:
    out_dir, img_dir = Path(args.out_dir), Path(args.img_dir)
    img_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for workload in args.workloads.split(","):
        sweeps: dict[str, Sweep] = {}
        for mode in args.modes.split(","):
            path = out_dir / f"{workload}-{mode}.json"
            if path.exists():
                sweeps[mode] = json.loads(path.read_text())
        if not sweeps:
            continue
        slo = R.slos(
            list(sweeps.values()), args.ttft_factor, args.tpot_factor,
            R.parse_slo_overrides(args.slo),
        )  # fmt: skip
        results = {m: R.summarize_sweep(s, slo) for m, s in sweeps.items()}
        png = img_dir / f"{image_prefix}-{workload}.png"
        R.plot_workload(workload, sweeps, results, slo, png)
        table = R.markdown_table(workload, results, slo)
        counts = {m: s["server"] for m, s in sweeps.items() if s.get("server")}
        if counts:
            table += (
                "\nServer counts over each sweep (calibration included): "
                + "; ".join(
                    f"{m}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(c.items()))
                    for m, c in counts.items()
                )
                + "\n"
            )
        print(table)
        (out_dir / f"{workload}-summary.json").write_text(
            json.dumps(R.summary_json(results, slo), indent=1)
        )
        (out_dir / f"{workload}-detail.md").write_text(R.detail_table(results))
        rel = os.path.relpath(png, Path(args.doc).parent)
        sections.append(f"{table}\n![{workload}]({rel})\n")
    if args.doc and sections:
        command = next(iter(sweeps.values())).get("command", "")
        _write_doc(Path(args.doc), sections, command, markers)
        print(f"updated {args.doc}")
    return 0


def _write_doc(
    doc: Path, sections: list[str], command: str, markers: tuple[str, str] = (DOC_BEGIN, DOC_END)
) -> None:
    begin, end = markers
    body = (
        f"{begin}\nTables and plots drawn {time.strftime('%Y-%m-%d %H:%M')} from the "
        f"results of:\n\n```\n{command}\n```\n\n" + "\n".join(sections) + f"{end}"
    )
    text = doc.read_text() if doc.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + body + rest.split(end, 1)[1]
    else:
        text += "\n" + body + "\n"
    doc.write_text(text)


_ARGV: list[str] = []  # this run's arguments, recorded with its results


def _command() -> str:
    return "disagg bench " + " ".join(shlex.quote(a) for a in _ARGV)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, many: bool) -> None:
        sp.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
        sp.add_argument("--num-requests", type=int, default=12, help="per rate, warm-up included")
        sp.add_argument("--warmup", type=int, default=2, help="requests left out, per rate")
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--rates", help="comma-separated req/s (default: per workload)")
        sp.add_argument("--ttft-factor", type=float, default=3.0, help="SLO: x unloaded p50")
        sp.add_argument("--tpot-factor", type=float, default=2.0, help="SLO: x unloaded p50")
        sp.add_argument(
            "--slo", action="append", default=[], metavar="CLASS=TTFT_MS:TPOT_MS",
            help="a class's SLO outright instead of calibrating it (repeatable)",
        )  # fmt: skip
        if many:
            sp.add_argument("--workloads", default=",".join(W.WORKLOADS))
            sp.add_argument("--modes", default=",".join(MODES))
            sp.add_argument("--out-dir", default="results/modes")
            sp.add_argument("--img-dir", default="docs/img")
            sp.add_argument("--doc", default="docs/benchmarks.md")

    run = sub.add_parser("run", help="one workload against a running server")
    common(run, many=False)
    run.add_argument("--workload", choices=list(W.WORKLOADS), default="chat")
    run.add_argument("--target", choices=("triton", "gateway"), default="triton")
    run.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC, or the gateway URL")
    run.add_argument("--model", default="router", help="Triton model, or the gateway's model")
    run.add_argument("--label", default="", help="name of this server in tables and plots")
    run.add_argument("--out", help="results JSON (a PNG is written next to it)")
    run.set_defaults(func=cmd_run)

    cmp_ = sub.add_parser("compare", help="the three serving modes on each workload")
    common(cmp_, many=True)
    cmp_.add_argument("--config", help="serve settings TOML (mode and ports are set here)")
    cmp_.add_argument("--model", default="router", help="the entry model requests go to")
    cmp_.set_defaults(func=cmd_compare, target="triton", url="")

    from disagg.bench.topology import TOPOLOGIES

    clu = sub.add_parser("cluster", help="topologies with a core per node (colocated 2x1, "
                         "disaggregated 1+1, conditional 1+1)")  # fmt: skip
    common(clu, many=True)
    clu.set_defaults(modes=",".join(TOPOLOGIES), out_dir="results/topologies")
    clu.add_argument("--config", help="serve settings TOML every node starts from")
    clu.add_argument("--model", default="router", help="the entry model requests go to")
    clu.set_defaults(func=cmd_cluster, target="triton", url="")

    rep = sub.add_parser("report", help="tables and plots from saved compare results")
    common(rep, many=True)
    rep.set_defaults(func=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    _ARGV[:] = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    code: int = args.func(args)
    return code
