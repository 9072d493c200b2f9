#!/usr/bin/env python3
"""Resident memory of every model process on an idle server (the default `make serve` setup).

    .venv/bin/python benchmarks/stub_rss.py [--out results/stub_rss.json]

Starts a tritonserver with default settings on free loopback ports, waits until every model
is ready and the stubs have settled, then reads each stub's /proc/<pid>/status: VmRSS, and
its split into RssAnon (the process's own memory), RssFile (mapped libraries and weights)
and RssShmem. Prints a table and writes JSON. Stubs that never run the model (router,
orchestrator, tokenizer) should not load torch: `torch` says whether libtorch is mapped.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from disagg.serve.server import TritonServer, free_ports
from disagg.serve.supervisor import stub_processes

try:
    from disagg.settings import ServeSettings
except ImportError:  # before settings moved out of disagg.serve (to measure older commits)
    from disagg.serve.settings import ServeSettings

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def memory(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    out = {}
    for line in status:
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    out["torch"] = "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    p.add_argument("--settle-s", type=float, default=10.0, help="idle time before reading")
    p.add_argument("--out", default="results/stub_rss.json")
    a = p.parse_args()
    http, grpc, metrics = free_ports(3)
    with tempfile.TemporaryDirectory() as build:
        settings = ServeSettings(
            engine_dir=str(Path(a.engine_dir).resolve()),
            build_dir=build,
            http_port=http,
            grpc_port=grpc,
            metrics_port=metrics,
        )
        server = TritonServer(settings, admin_key="stub-rss")
        print("starting tritonserver ...", file=sys.stderr, flush=True)
        server.start()
        try:
            server.wait_ready(timeout_s=300)
            print(f"ready; idle for {a.settle_s:g} s ...", file=sys.stderr, flush=True)
            time.sleep(a.settle_s)
            rows = []
            for pid, (model, _) in sorted(stub_processes(server.proc.pid).items()):
                rows.append({"model": model, "pid": pid, **memory(pid)})
        finally:
            server.stop()
    rows.sort(key=lambda r: r["model"])
    print(f"{'model':<20} {'RSS MiB':>8} {'anon':>8} {'file':>8} {'torch':>6}")
    for r in rows:
        print(
            f"{r['model']:<20} {r['VmRSS']:>8.0f} {r['RssAnon']:>8.0f} {r['RssFile']:>8.0f} "
            f"{'yes' if r['torch'] else 'no':>6}"
        )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "benchmarks/stub_rss.py " + " ".join(sys.argv[1:]),
                "machine": platform.processor() or platform.machine(),
                "stubs": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
