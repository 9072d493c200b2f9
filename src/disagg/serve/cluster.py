"""`disagg cluster` (make cluster): a multi-server topology on this machine, for anyone to try.

    disagg cluster [--prefill 2] [--decode 2] [--config serve.toml]

Starts each node as its own `disagg serve --role <role>` process (own ports, own process
group, own build directory under <build_dir>/cluster/): the prefill and decode servers first,
then the frontend (gateway on its usual port 9000, Triton on 8000/8001) with the pools as
replicas. Every node shares one internal token (generated here, never written to disk) and
one admin key. Ctrl-C stops them all. On one 2-core machine this shows the topology and its
failure handling, not speed: the nodes share the cores (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from disagg.contracts import ADMIN_KEY_ENV, TOKEN_ENV, internal_token
from disagg.settings import ServeSettings

BASE_PORT = 8100  # prefill servers from here, decode servers 100 higher, ten apart


@dataclass(frozen=True)
class Node:
    name: str
    role: str
    env: dict[str, str]  # DISAGG_* settings of this node

    @property
    def http(self) -> str:
        return f"http://{self.env.get('DISAGG_HOST', '127.0.0.1')}:{self.env['DISAGG_HTTP_PORT']}"

    @property
    def grpc(self) -> str:
        return f"{self.env.get('DISAGG_HOST', '127.0.0.1')}:{self.env['DISAGG_GRPC_PORT']}"


def plan(
    settings: ServeSettings, prefill: int, decode: int, build_dir: Path, base_port: int = BASE_PORT
) -> list[Node]:
    """The nodes of the topology, pools first, the frontend last."""
    nodes = []
    for role, count in (("prefill", prefill), ("decode", decode)):
        for i in range(count):
            base = base_port + (100 if role == "decode" else 0) + 10 * i
            env = {
                "DISAGG_ROLE": role,
                "DISAGG_HTTP_PORT": str(base),
                "DISAGG_GRPC_PORT": str(base + 1),
                "DISAGG_METRICS_PORT": str(base + 2),
                "DISAGG_KV_PORT": str(base + 5),
                # its prefix cache's events, instance i on base + 6 + i (kvevents.py)
                "DISAGG_KV_EVENTS_PORT": str(base + 6),
                "DISAGG_BUILD_DIR": str(build_dir / f"{role}-{i}"),
            }
            nodes.append(Node(f"{role}-{i}", role, env))
    replicas = {
        role: ",".join(n.grpc for n in nodes if n.role == role) for role in ("prefill", "decode")
    }
    frontend = {
        "DISAGG_ROLE": "frontend",
        "DISAGG_HTTP_PORT": str(settings.http_port),
        "DISAGG_GRPC_PORT": str(settings.grpc_port),
        "DISAGG_METRICS_PORT": str(settings.metrics_port),
        "DISAGG_GATEWAY_PORT": str(settings.gateway_port),
        "DISAGG_PREFILL_REPLICAS": replicas["prefill"],
        "DISAGG_DECODE_REPLICAS": replicas["decode"],
        "DISAGG_BUILD_DIR": str(build_dir / "frontend"),
    }
    return [*nodes, Node("frontend", "frontend", frontend)]


class Cluster:
    def __init__(self, nodes: list[Node], config: str | None = None) -> None:
        self.nodes = nodes
        self.config = config
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.secrets = {
            TOKEN_ENV: internal_token() or secrets.token_hex(16),
            ADMIN_KEY_ENV: os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(24),
        }

    def start(self, node: Node) -> subprocess.Popen[bytes]:
        log_dir = Path(node.env["DISAGG_BUILD_DIR"])
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "disagg", "serve", "--role", node.role]
        if self.config:
            cmd += ["--config", self.config]
        log = open(log_dir / "serve.log", "w")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **node.env, **self.secrets},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as one
        )
        self.procs[node.name] = proc
        return proc

    def wait_ready(self, nodes: list[Node], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(nodes)
        while waiting:
            for node in list(waiting):
                proc = self.procs[node.name]
                if proc.poll() is not None:
                    log = Path(node.env["DISAGG_BUILD_DIR"]) / "serve.log"
                    raise RuntimeError(f"{node.name} exited; its log:\n{log.read_text()[-3000:]}")
                if _ready(node.http):
                    print(f"  {node.name:<10} ready  gRPC {node.grpc}", flush=True)
                    waiting.remove(node)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"not ready after {timeout_s:.0f} s: {[n.name for n in waiting]}"
                )
            time.sleep(0.5)

    def up(self) -> None:
        pools = [n for n in self.nodes if n.role != "frontend"]
        for node in pools:
            self.start(node)
        self.wait_ready(pools)
        front = [n for n in self.nodes if n.role == "frontend"]
        for node in front:
            self.start(node)
        self.wait_ready(front)

    def stop(self, name: str | None = None, sig: int = signal.SIGTERM) -> None:
        for node_name, proc in list(self.procs.items()):
            if name is not None and node_name != name:
                continue
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
        # Longer than a serve process's own wait for its tritonserver (drain_s + 20 s): it
        # must get to kill that server itself. Triton runs in a session of its own, so
        # killing the serve process's group first would leave it behind (seen once in CI).
        timeout_s = ServeSettings.load(self.config).drain_s + 40.0
        for node_name, proc in list(self.procs.items()):
            if name is None or node_name == name:
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http}/v2/health/ready", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="disagg cluster", description=__doc__.split("\n")[0])
    p.add_argument("--prefill", type=int, default=2, help="prefill servers")
    p.add_argument("--decode", type=int, default=2, help="decode servers")
    p.add_argument("--config", help="TOML settings every node starts from")
    p.add_argument("--base-port", type=int, default=BASE_PORT, help="first port of the pools")
    a = p.parse_args(argv)
    settings = ServeSettings.load(a.config)
    build = settings.path("build_dir") / "cluster"
    nodes = plan(settings, a.prefill, a.decode, build, a.base_port)
    cluster = Cluster(nodes, a.config)
    print(f"starting {len(nodes)} servers (logs under {settings.path('build_dir')}/cluster/)")
    try:
        cluster.up()
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        cluster.stop()
        return 2
    print(
        f"\ndisagg cluster: {a.prefill} prefill + {a.decode} decode servers behind the frontend\n"
        f"  OpenAI  http://{settings.host}:{settings.gateway_port}/v1 (API key: see "
        f"{settings.path('build_dir')}/cluster/frontend/serve.log)\n"
        f"  gRPC    {nodes[-1].grpc}\n"
        "Ctrl-C stops every server.",
        flush=True,
    )
    stopping = []
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    while not stopping:
        time.sleep(0.5)
    print("\nstopping every server ...", flush=True)
    cluster.stop()
    return 0
