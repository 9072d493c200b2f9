"""`disagg cluster` (make cluster): a multi-server topology on this machine, for anyone to try.

    disagg cluster [--prefill 2] [--decode 2] [--config serve.toml] [--autoscale ...]

Starts each node as its own `disagg serve --role <role>` process (own ports, own process
group, own build directory under <build_dir>/cluster/): the prefill and decode servers first,
then the frontend (gateway on its usual port 9000, Triton on 8000/8001) with the pools as
replicas. Every node shares one internal token (generated here, never written to disk) and
one admin key. Ctrl-C stops them all; so does the death of this process (each node gets
SIGTERM from the kernel). With --autoscale the live planner adds and drains pool servers
as the load asks (ClusterActuator, docs/planner.md). On one 2-core machine this shows the
topology and its failure handling, not speed: the nodes share the cores (docs/scale-out.md).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from disagg import status as S
from disagg.contracts import ADMIN_KEY_ENV, TOKEN_ENV, internal_token
from disagg.process import PARENT_ENV
from disagg.remote.replicas import RESOLVE_S
from disagg.settings import ServeSettings

if TYPE_CHECKING:
    from disagg.planner.live import Targets

BASE_PORT = 8100  # prefill servers from here, decode servers 100 higher, ten apart
MAX_POOL = 10  # servers of one pool (the 11th prefill server's ports would be decode's)


@dataclass(frozen=True)
class Node:
    name: str
    role: str
    env: dict[str, str]  # DISAGG_* settings of this node

    @property
    def http(self) -> str:
        return f"http://{self.env.get('DISAGG_HOST', '127.0.0.1')}:{self.env['DISAGG_HTTP_PORT']}"

    @property
    def metrics(self) -> str:
        host = self.env.get("DISAGG_HOST", "127.0.0.1")
        return f"http://{host}:{self.env['DISAGG_METRICS_PORT']}/metrics"

    @property
    def grpc(self) -> str:
        return f"{self.env.get('DISAGG_HOST', '127.0.0.1')}:{self.env['DISAGG_GRPC_PORT']}"


def pool_node(role: str, i: int, build_dir: Path, base_port: int = BASE_PORT) -> Node:
    """The i-th server of a pool: its ports (ten apart from base_port, decode 100 higher)."""
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
    return Node(f"{role}-{i}", role, env)


def plan(
    settings: ServeSettings,
    prefill: int,
    decode: int,
    build_dir: Path,
    base_port: int = BASE_PORT,
    lists: dict[str, Path] | None = None,
) -> list[Node]:
    """The nodes of the topology, pools first, the frontend last. With `lists` ({pool: a
    file}), the frontend reads each pool's replicas from its file, re-read as it changes
    (remote/replicas.py), so that pool servers can come and go (the live planner)."""
    nodes = [
        pool_node(role, i, build_dir, base_port)
        for role, count in (("prefill", prefill), ("decode", decode))
        for i in range(count)
    ]
    replicas = {
        role: ",".join(n.grpc for n in nodes if n.role == role) for role in ("prefill", "decode")
    }
    for role, path in (lists or {}).items():
        write_list(path, replicas[role].split(","))
        replicas[role] = f"file:{path}"
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


def write_list(path: Path, addresses: list[str]) -> None:
    """A pool's replica file, replaced whole (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(a + "\n" for a in addresses if a))
    os.replace(tmp, path)


class Cluster:
    def __init__(self, nodes: list[Node], config: str | None = None) -> None:
        self.nodes = nodes
        self.config = config
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, IO[bytes]] = {}  # each node's log, ours to close once it exits
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
        log = self.logs[node.name] = open(log_dir / "serve.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            cmd,
            # PARENT_ENV: SIGTERM when this process dies, even by SIGKILL (serve's main)
            env={**os.environ, **node.env, **self.secrets, PARENT_ENV: str(os.getpid())},
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
                del self.procs[node_name]  # stopped: forgotten, its log closed
                if (log := self.logs.pop(node_name, None)) is not None:
                    log.close()


class ClusterActuator:
    """The live planner's hands in `disagg cluster --autoscale` (planner/autoscale.py). A pool
    server is started as its own `disagg serve --role` process; once ready, its address is
    added to the pool's replica file, which the frontend re-reads (remote/replicas.py).
    Draining is the reverse: the address leaves the file first; after the frontend's re-read
    (`RESOLVE_S`) no new request goes there; a decode server is left until its sequences
    have finished (its disagg_decode_active_sequences, up to `drain_timeout_s`); then
    SIGTERM, on which tritonserver finishes what is still in flight (drain_s) and exits.
    The newest server leaves first. Each call blocks until done."""

    def __init__(
        self,
        cluster: Cluster,
        build_dir: Path,
        lists: dict[str, Path],
        base_port: int = BASE_PORT,
        drain_timeout_s: float = 120.0,
        ready_timeout_s: float = 300.0,
    ) -> None:
        self.cluster = cluster
        self.build_dir = build_dir
        self.lists = lists
        self.base_port = base_port
        self.drain_timeout_s = drain_timeout_s
        self.ready_timeout_s = ready_timeout_s

    def running(self, pool: str) -> list[Node]:
        """The pool's servers, in the order they were started."""
        return [n for n in self.cluster.nodes if n.role == pool]

    def set_replicas(self, pool: str, count: int) -> None:
        while len(self.running(pool)) < count:
            self.add(pool)
        while len(self.running(pool)) > count:
            self.drain(self.running(pool)[-1])

    def add(self, pool: str) -> Node:
        used = {n.name for n in self.cluster.nodes}
        i = next(i for i in range(len(used) + 1) if f"{pool}-{i}" not in used)
        node = pool_node(pool, i, self.build_dir, self.base_port)
        started = time.monotonic()
        self.cluster.start(node)
        try:
            self.cluster.wait_ready([node], self.ready_timeout_s)
        except (RuntimeError, TimeoutError):
            self.cluster.stop(node.name)
            raise
        self.cluster.nodes.insert(self._pools_end(), node)
        self._write(pool)
        print(
            f"  {node.name} listed, {time.monotonic() - started:.1f} s after its start", flush=True
        )
        return node

    def drain(self, node: Node) -> None:
        started = time.monotonic()
        self.cluster.nodes.remove(node)
        self._write(node.role)
        time.sleep(RESOLVE_S + 1.0)  # the frontend has re-read the file: nothing new comes
        if node.role == "decode":
            deadline = time.monotonic() + self.drain_timeout_s
            while _active(node) > 0 and time.monotonic() < deadline:
                time.sleep(0.5)
        self.cluster.stop(node.name)
        print(
            f"  {node.name} drained and stopped in {time.monotonic() - started:.1f} s", flush=True
        )

    def _write(self, pool: str) -> None:
        write_list(self.lists[pool], [n.grpc for n in self.running(pool)])

    def _pools_end(self) -> int:
        """Where a pool server goes in the node list: before the frontend."""
        return next((i for i, n in enumerate(self.cluster.nodes) if n.role == "frontend"),
                    len(self.cluster.nodes))  # fmt: skip


def _active(node: Node) -> float:
    """The decode sequences a server still runs (0 once its metrics are unreadable)."""
    try:
        with urllib.request.urlopen(node.metrics, timeout=2) as r:
            return S.total(S.parse(r.read().decode()), "disagg_decode_active_sequences")
    except OSError:
        return 0.0


def _ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http}/v2/health/ready", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    from disagg.planner import autoscale

    p = argparse.ArgumentParser(prog="disagg cluster", description=__doc__.split("\n")[0])
    p.add_argument("--prefill", type=int, default=2, help="prefill servers")
    p.add_argument("--decode", type=int, default=2, help="decode servers")
    p.add_argument("--config", help="TOML settings every node starts from")
    p.add_argument("--base-port", type=int, default=BASE_PORT, help="first port of the pools")
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="the live planner starts and drains pool servers (docs/planner.md)",
    )
    autoscale.add_target_args(p)
    a = p.parse_args(argv)
    targets = autoscale.targets_from(a) if a.autoscale else None
    if max(a.prefill, a.decode) > MAX_POOL or a.decode < 1 or a.prefill < 0:
        p.error(f"--prefill 0..{MAX_POOL} and --decode 1..{MAX_POOL} (ports are 10 apart)")
    if targets is not None:
        if not (targets.min_prefill <= a.prefill <= targets.max_prefill
                and targets.min_decode <= a.decode <= targets.max_decode):  # fmt: skip
            p.error("--prefill and --decode must lie within the planner's --min/--max")
        if max(targets.max_prefill, targets.max_decode) > MAX_POOL:
            p.error(f"at most {MAX_POOL} servers a pool here (their ports are 10 apart)")
    settings = ServeSettings.load(a.config)
    build = settings.path("build_dir") / "cluster"
    lists = {pool: build / f"{pool}-replicas.txt" for pool in ("prefill", "decode")}
    nodes = plan(settings, a.prefill, a.decode, build, a.base_port, lists if a.autoscale else None)
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
    stopping: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    if targets is not None:
        _autoscale(cluster, settings, build, lists, a, targets, lambda: bool(stopping))
    while not stopping:
        time.sleep(0.5)
    print("\nstopping every server ...", flush=True)
    cluster.stop()
    return 0


def _autoscale(
    cluster: Cluster,
    settings: ServeSettings,
    build: Path,
    lists: dict[str, Path],
    a: argparse.Namespace,
    targets: Targets,
    stopped: Callable[[], bool],
) -> None:
    """The live planner in this process until Ctrl-C; errors starting a server end it, not
    the cluster."""
    from disagg.planner.autoscale import Autoscaler
    from disagg.planner.live import Planner

    actuator = ClusterActuator(cluster, build, lists, a.base_port)
    (front,) = [n for n in cluster.nodes if n.role == "frontend"]
    scaler = Autoscaler(Planner(targets, a.prefill, a.decode), actuator, [front.metrics],
                        a.planner_interval_s, a.planner_log)  # fmt: skip
    if a.planner_port:
        scaler.metrics.serve(a.planner_port, settings.host)
    print(
        f"live planner: prefill {a.prefill}..{targets.max_prefill}, decode "
        f"{a.decode}..{targets.max_decode}, every {a.planner_interval_s:g} s",
        flush=True,
    )
    try:
        scaler.run(stopped)
    except (RuntimeError, TimeoutError) as e:
        print(f"live planner stopped: {e}", file=sys.stderr, flush=True)
