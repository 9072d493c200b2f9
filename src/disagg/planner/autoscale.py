"""`disagg planner`: the live planner's loop. Every interval it reads the frontends' Triton
metrics, turns the change since the last read into a `live.Window`, and carries out what
`live.Planner` decides through an actuator (below).

    disagg cluster --prefill 1 --decode 1 --autoscale     # starts and drains local servers
    disagg planner --metrics http://frontend:8002/metrics --observe --port 9400  # Kubernetes

Each decision is printed, appended as a JSON line to `--log`, and counted on the planner's
own /metrics (disagg_planner_decisions_total{pool,action,reason}, disagg_planner_replicas,
disagg_planner_signal), which `disagg status --planner` shows.

Actuators: `serve/cluster.py` `ClusterActuator` starts and drains local pool servers;
`DesiredReplicas` (Kubernetes) changes nothing itself: the planner publishes each pool's
count as `disagg_planner_replicas{pool}`, which prometheus-adapter hands the pools'
HorizontalPodAutoscalers as an external metric (deploy/kubernetes/components/planner), so
the HPA stays the one writer of the Deployments' replicas, within its own min, max and
behaviour, and the planner needs no write access to the Kubernetes API (docs/planner.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from disagg import metrics as M
from disagg import status as S
from disagg.planner.live import DECODE, PREFILL, SOURCE, Decision, Planner, Targets, Window
from disagg.remote.replicas import resolve


class Actuator(Protocol):
    def set_replicas(self, pool: str, count: int) -> None: ...


class DesiredReplicas:
    """Kubernetes: only what the planner wants; the HPA acts on it."""

    def __init__(self) -> None:
        self.wanted: dict[str, int] = {}

    def set_replicas(self, pool: str, count: int) -> None:
        self.wanted[pool] = count


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        d, n, g = M.PLANNER_DECISIONS, M.PLANNER_REPLICAS, M.PLANNER_SIGNAL
        self.decisions = Counter(d.name.removesuffix("_total"), d.help, d.labels, registry=r)
        self.replicas = Gauge(n.name, n.help, n.labels, registry=r)
        self.signal = Gauge(g.name, g.help, g.labels, registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, host, registry=self.registry)


class Autoscaler:
    def __init__(
        self,
        planner: Planner,
        actuator: Actuator,
        sources: list[str],
        interval_s: float = 2.0,
        log_path: Path | None = None,
        observe: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`observe`: each pool's replica count is read from the frontends'
        disagg_replica_up (someone else, the HPA, starts and stops them)."""
        self.planner = planner
        self.actuator = actuator
        self.sources = sources
        self.interval_s = interval_s
        self.log_path = log_path
        self.observe = observe
        self.clock = clock
        self.metrics = PlannerMetrics()
        self.history: deque[tuple[float, list[S.Sample]]] = deque()
        if not observe:  # observing: nothing until the frontends were read (an HPA would
            self._publish()  # take a default count for the planner's wish)

    def _publish(self) -> None:
        for pool in (PREFILL, DECODE):
            self.metrics.replicas.labels(pool).set(self.planner.replicas(pool))

    def scrape(self) -> list[S.Sample]:
        """Every frontend's metrics together (a source "dns:<name>:<port>" is every address
        the name has now: each frontend pod behind a headless Service)."""
        out: list[S.Sample] = []
        for source in self.sources:
            urls = [source]
            if source.startswith("dns:"):
                name, _, port = source[4:].rpartition(":")
                urls = [f"http://{a}/metrics" for a in resolve(name, int(port))]
            for url in urls:
                with urllib.request.urlopen(url, timeout=5) as r:
                    tag = ((SOURCE, url),)
                    out += [
                        S.Sample(x.name, tuple(sorted(x.labels + tag)), x.value)
                        for x in S.parse(r.read().decode())
                        if x.label(SOURCE) == ""
                    ]
        return out

    def step(self, now: list[S.Sample], t: float | None = None) -> list[Decision]:
        """One scrape taken at `t`: the windows of the last up_for_s and down_for_s, the
        decisions, each carried out (blocking)."""
        t = self.clock() if t is None else t
        self.history.append((t, now))
        span = max(self.planner.targets.up_for_s, self.planner.targets.down_for_s)
        while len(self.history) > 2 and self.history[1][0] <= t - span:
            self.history.popleft()  # the oldest that still covers the longest span stays
        if self.observe:  # the replicas any frontend has in rotation (each counted once)
            for pool in (PREFILL, DECODE):
                up = {
                    s.label("replica") for s in now
                    if s.name == "disagg_replica_up" and s.label("pool") == pool and s.value >= 1
                }  # fmt: skip
                if up:
                    self.planner.pools[pool].replicas = len(up)
        targets = self.planner.targets
        w_up, w_down = self.window(targets.up_for_s, t), self.window(targets.down_for_s, t)
        shown = w_up or self.window(0.0, t)
        if shown is not None:
            for name in ("queue_p90_s", "ttft_p90_s", "itl_p90_s", "decode_in_flight"):
                self.metrics.signal.labels(name).set(getattr(shown, name))
            self.metrics.signal.labels("prefill_busy").set(shown.prefill_busy_s / shown.seconds)
        decisions = self.planner.observe(t, w_up, w_down)
        self._publish()
        for d in decisions:
            self.record(d)
            self.actuator.set_replicas(d.pool, d.replicas)
        return decisions

    def window(self, span: float, t: float) -> Window | None:
        """The scrapes of the last `span` seconds (from the newest one at least that old);
        None while the history is shorter. `span` 0: the last two scrapes."""
        if span <= 0:
            part = list(self.history)[-2:]
        else:
            older = [i for i, (at, _) in enumerate(self.history) if at <= t - span + 1e-6]
            part = list(self.history)[older[-1] :] if older else []
        if len(part) < 2:
            return None
        return Window.between([x for _, x in part], part[-1][0] - part[0][0], t)

    def record(self, d: Decision) -> None:
        self.metrics.decisions.labels(d.pool, d.action, d.reason).inc()
        self.metrics.replicas.labels(d.pool).set(d.replicas)
        line = {"time": time.time(), **asdict(d)}
        print(f"planner: {d.pool} {d.action} to {d.replicas} ({d.reason}: {d.detail})",
              flush=True)  # fmt: skip
        if self.log_path is not None:
            with self.log_path.open("a") as f:
                f.write(json.dumps(line) + "\n")

    def run(self, stop: threading.Event | Callable[[], bool]) -> None:
        stopped = stop.is_set if isinstance(stop, threading.Event) else stop
        while not stopped():
            now = self._read()
            if now is None:  # a frontend unreadable: the windows start again
                self.history.clear()
            elif self.step(now):
                self.history.clear()  # what came before the action saw other replicas
            time.sleep(self.interval_s)

    def _read(self) -> list[S.Sample] | None:
        try:
            return self.scrape()
        except OSError as e:
            print(f"planner: cannot read the frontend's metrics: {e}", file=sys.stderr)
            return None


def add_target_args(p: argparse.ArgumentParser) -> None:
    d = Targets()
    g = p.add_argument_group("live planner")
    g.add_argument("--slo-ttft-ms", type=float, default=d.ttft_s * 1e3, help="TTFT p90 target")
    g.add_argument("--queue-ms", type=float, default=d.queue_s * 1e3,
                   help="prefill queue p90 above which a prefill replica is added")  # fmt: skip
    g.add_argument("--slo-itl-ms", type=float, default=d.itl_s * 1e3, help="ITL p90 target")
    g.add_argument("--decode-seqs", type=int, default=d.decode_seqs,
                   help="sequences one decode replica runs at once")  # fmt: skip
    g.add_argument("--up-for-s", type=float, default=d.up_for_s)
    g.add_argument("--down-for-s", type=float, default=d.down_for_s)
    g.add_argument("--cooldown-s", type=float, default=d.cooldown_s)
    g.add_argument("--min-prefill", type=int, default=d.min_prefill)
    g.add_argument("--max-prefill", type=int, default=d.max_prefill)
    g.add_argument("--min-decode", type=int, default=d.min_decode)
    g.add_argument("--max-decode", type=int, default=d.max_decode)
    g.add_argument("--planner-interval-s", type=float, default=2.0)
    g.add_argument("--planner-port", type=int, default=0, help="the planner's /metrics (0: none)")
    g.add_argument("--planner-log", type=Path, default=None, help="decisions as JSON lines")


FLAGS = {"ttft_s": "--slo-ttft-ms", "queue_s": "--queue-ms", "itl_s": "--slo-itl-ms"}


def targets_from(a: argparse.Namespace) -> Targets:
    """The targets the flags give, or SystemExit naming the flags that are wrong."""
    t = Targets(
        ttft_s=a.slo_ttft_ms / 1e3, queue_s=a.queue_ms / 1e3, itl_s=a.slo_itl_ms / 1e3,
        decode_seqs=a.decode_seqs, up_for_s=a.up_for_s, down_for_s=a.down_for_s,
        cooldown_s=a.cooldown_s, min_prefill=a.min_prefill, max_prefill=a.max_prefill,
        min_decode=a.min_decode, max_decode=a.max_decode,
    )  # fmt: skip
    bad = [k for k, v in asdict(t).items() if not (isinstance(v, int | float) and v > 0)]
    if not a.planner_interval_s > 0:
        bad.append("planner_interval_s")
    if bad:
        flags = [FLAGS.get(k, "--" + k.replace("_", "-")) for k in bad]
        raise SystemExit(f"disagg planner: these must be positive numbers: {', '.join(flags)}")
    if t.min_prefill > t.max_prefill or t.min_decode > t.max_decode:
        raise SystemExit("disagg planner: a pool's --min is above its --max")
    return t


def check_sources(sources: list[str]) -> None:
    """Each --metrics is an http(s) URL or dns:<name>:<port>, or SystemExit saying which."""
    for source in sources:
        if source.startswith("dns:"):
            name, _, port = source[4:].rpartition(":")
            if name and port.isdigit():
                continue
        elif source.startswith(("http://", "https://")):
            continue
        raise SystemExit(
            f"disagg planner: --metrics {source!r}: expected an http(s) URL or dns:<name>:<port>"
        )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg planner", description=__doc__.split("\n")[0])
    p.add_argument("--metrics", action="append", required=True,
                   help="a frontend's Triton metrics URL (repeat for each frontend)")  # fmt: skip
    p.add_argument("--prefill", type=int, default=1, help="prefill replicas now")
    p.add_argument("--decode", type=int, default=1, help="decode replicas now")
    p.add_argument("--observe", action="store_true",
                   help="follow the replica counts the frontends see (Kubernetes)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address of the planner's /metrics")
    add_target_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    check_sources(a.metrics)
    planner = Planner(targets_from(a), a.prefill, a.decode)
    scaler = Autoscaler(planner, DesiredReplicas(), a.metrics, a.planner_interval_s,
                        a.planner_log, observe=a.observe)  # fmt: skip
    if a.planner_port:
        scaler.metrics.serve(a.planner_port, a.host)
    print(f"disagg planner: reading {', '.join(a.metrics)} every {a.planner_interval_s:g} s",
          flush=True)  # fmt: skip
    with contextlib.suppress(KeyboardInterrupt):
        scaler.run(threading.Event())
    return 0
