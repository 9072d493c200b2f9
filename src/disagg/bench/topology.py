"""`disagg bench cluster`: serving topologies on equal hardware, each pool node pinned to a
core of its own (the `cpus` setting: tritonserver and its model processes on that core):

  colocated      two decode servers (cores 0 and 1), each prefilling its own requests,
                 behind one frontend
  disaggregated  a prefill server (core 0) and a decode server (core 1) behind one frontend,
                 KV pulled over TCP
  conditional    the same two, the frontend's cost model choosing per request

The frontend (tokenizer, router, orchestrator) is not pinned: on a 2-core machine it shares
the cores with the nodes in every topology alike. Each topology gets the same seeded requests
per workload; results, plots and the docs/benchmarks.md section come from report.py.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from disagg.contracts import TOKEN_ENV

if TYPE_CHECKING:
    from disagg.serve.server import TritonServer
    from disagg.settings import ServeSettings

TOPOLOGIES = {
    "colocated": ("colocated", (("decode", "0"), ("decode", "1"))),
    "disaggregated": ("disaggregated", (("prefill", "0"), ("decode", "1"))),
    "conditional": ("conditional", (("prefill", "0"), ("decode", "1"))),
}
DOC_BEGIN = "<!-- topologies:begin (written by disagg bench cluster) -->"
DOC_END = "<!-- topologies:end -->"


@contextlib.contextmanager
def serve(base: ServeSettings, name: str, out_dir: Path) -> Iterator[TritonServer]:
    """The servers of topology `name`, ready; yields the frontend, stops them all after."""
    from disagg.serve.server import TritonServer, free_ports

    os.environ.setdefault(TOKEN_ENV, secrets.token_hex(16))
    mode, nodes = TOPOLOGIES[name]
    pools = []
    for i, (role, core) in enumerate(nodes):
        http, grpc, metrics = free_ports(3)
        s = replace(
            base, role=role, cpus=core, http_port=http, grpc_port=grpc, metrics_port=metrics,
            prefill_torch_threads=1, decode_torch_threads=1, gateway_enabled=False,
            build_dir=str(out_dir / "triton" / f"{name}-{role}{i}"),
        )  # fmt: skip
        pools.append(TritonServer(s).start())
    try:
        for server in pools:
            server.wait_ready(timeout_s=300)
        replicas = {
            role: ",".join(p.endpoints.grpc for p in pools if p.settings.role == role)
            for role in ("prefill", "decode")
        }
        http, grpc, metrics = free_ports(3)
        front = replace(
            base, role="frontend", mode=mode, http_port=http, grpc_port=grpc,
            metrics_port=metrics, gateway_enabled=False, conditional_remote_stall=0.0,
            prefill_replicas=replicas["prefill"], decode_replicas=replicas["decode"],
            build_dir=str(out_dir / "triton" / f"{name}-frontend"),
        )  # fmt: skip
        frontend = TritonServer(front).start()
        try:
            frontend.wait_ready(timeout_s=300)
            yield frontend
        finally:
            frontend.stop()
    finally:
        for server in pools:
            server.stop()
