"""disagg's metrics (disagg.metrics) on Triton's metrics port, from inside a model process."""

from __future__ import annotations

import dataclasses
import gc
import logging
import queue
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import triton_python_backend_utils as pb_utils

from disagg import metrics as M
from disagg.contracts import DecodeStats
from disagg.engine.prefix_cache import PrefixCacheStats

if TYPE_CHECKING:
    from triton_python_backend_utils import _MetricKind

    from disagg.pipeline.conditional import Load
    from disagg.remote.replicas import ReplicaSet

_log = logging.getLogger("disagg.triton")


def _family_kind(kind: str) -> _MetricKind:
    # looked up late: the stub that auto-completes configs has no MetricFamily
    found: _MetricKind = getattr(pb_utils.MetricFamily, kind.upper())
    return found


class _MetricsThread:
    """Applies every metric update of this model process on one thread, in order.

    Each update is a synchronous message from the stub to the server. Made from many request
    threads at once (one histogram observation per token), they crashed Triton 2.51's Python
    backend (SIGSEGV in libtriton_python.so under 8 concurrent streams); one thread also keeps
    that round trip off the request path. Updates land a moment after they are made."""

    def __init__(self) -> None:
        self.updates: queue.SimpleQueue[_Update | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (update := self.updates.get()) is not None:
            family, labels, op, value = update
            try:
                family.apply(labels, op, value)
            except Exception:  # metrics must never take the model down
                _log.exception("metric %s: %s failed", family.spec.name, op)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Apply what is queued, then end."""
        self.updates.put(None)
        self.thread.join(timeout_s)


_Labels = tuple[tuple[str, str], ...]  # a series' labels, sorted
_Update = tuple["Family", dict[str, str], str, float]  # (family, labels, op, value)
_metrics_thread: _MetricsThread | None = None
_metrics_lock = threading.Lock()
_families: list[Family] = []  # every Family of this process, for close_metrics


def _submit(family: Family, labels: dict[str, str], op: str, value: float) -> None:
    global _metrics_thread
    if _metrics_thread is None:
        with _metrics_lock:
            if _metrics_thread is None:
                _metrics_thread = _MetricsThread()
    _metrics_thread.updates.put((family, labels, op, value))


def close_metrics() -> None:
    """Call from a model's finalize(): stop the metrics thread, then free every Metric and
    MetricFamily while the stub can still talk to the server. Freed later, at interpreter
    exit, their destructors reach for the stub's shared memory pool after it is gone: that
    was the SIGSEGV ("segfault at 60 ... in triton_python_backend_stub") of every stub with
    metrics at every server shutdown."""
    global _metrics_thread
    with _metrics_lock:
        if _metrics_thread is not None:
            _metrics_thread.stop()
            _metrics_thread = None
        for family in _families:
            family.close()
        _families.clear()
    gc.collect()


class Family:
    """One metric of disagg.metrics on Triton's metrics port. Label sets are created on first
    use (their values come from small closed sets); `fixed` labels go on every series."""

    def __init__(self, metric: M.Metric, **fixed: str) -> None:
        self.spec = metric
        self.fixed = fixed
        self.family: pb_utils.MetricFamily | None = pb_utils.MetricFamily(
            metric.name, metric.help, _family_kind(metric.kind)
        )
        # touched by the metrics thread only
        self.series: dict[_Labels, pb_utils.Metric] = {}
        self.last_set: dict[_Labels, float] = {}  # gauges: the value the server has
        _families.append(self)
        if metric.kind == M.GAUGE and set(metric.labels) <= set(fixed):
            # A restarted model process gets the dead one's series back (Triton keeps a
            # series alive until its owner frees it, and a killed stub never does): without
            # this, a decode restarted after a crash reported the dead engine's sequences.
            self.set(0.0)

    def close(self) -> None:
        """Free the series, then the family (the order the Python backend asks for)."""
        self.series.clear()
        self.family = None

    def apply(self, labels: dict[str, str], op: str, value: float) -> None:
        """One update, on the metrics thread. A gauge set to the value it already has is not
        sent: decode sets its gauges after every step, and they rarely change."""
        if self.family is None:  # closed: the model is finalizing
            return
        key = tuple(sorted(labels.items()))
        if op == "set":
            if self.last_set.get(key) == value:
                return
            self.last_set[key] = value
        series = self.series.get(key)
        if series is None:
            extra = {"buckets": list(self.spec.buckets)} if self.spec.buckets else {}
            series = self.series[key] = self.family.Metric(labels=labels, **extra)
        getattr(series, op)(value)

    def inc(self, value: float = 1.0, **labels: str) -> None:
        if value:
            _submit(self, {**self.fixed, **labels}, "increment", value)

    def set(self, value: float, **labels: str) -> None:
        _submit(self, {**self.fixed, **labels}, "set", value)

    def observe(self, value: float, **labels: str) -> None:
        _submit(self, {**self.fixed, **labels}, "observe", value)


class RouterMetrics:
    """The router's counters, on Triton's metrics port (implements RouterEvents)."""

    def __init__(self) -> None:
        self.requests = Family(M.ROUTER_REQUESTS)
        self.fallbacks = Family(M.ROUTER_FALLBACKS)
        self.retries = Family(M.ROUTER_RETRIES)
        self.endpoint_errors = Family(M.ROUTER_ENDPOINT_ERRORS)

    def decision(self, target: str, reason: str) -> None:
        self.requests.inc(target=target, reason=reason)

    def fallback(self, planned: str, cause: str) -> None:
        self.fallbacks.inc(target=planned, cause=cause)

    def retry(self, endpoint: str) -> None:
        self.retries.inc(endpoint=endpoint)

    def endpoint_error(self, endpoint: str, kind: str) -> None:
        self.endpoint_errors.inc(endpoint=endpoint, kind=kind)


class OrchestratorMetrics:
    """The orchestrator's histograms and counters (implements OrchestratorEvents)."""

    def __init__(self, model: str) -> None:
        f = {"model": model}
        self.ttft, self.itl, self.e2e = Family(M.TTFT, **f), Family(M.ITL, **f), Family(M.E2E, **f)
        self.requests, self.errors = Family(M.REQUESTS, **f), Family(M.ERRORS, **f)
        self.queue, self.prefill_s = Family(M.QUEUE), Family(M.PREFILL)
        self.kv_bytes, self.kv_s = Family(M.KV_BYTES, **f), Family(M.KV_SECONDS, **f)
        self.kv_skipped = Family(M.KV_SKIPPED_BYTES, **f)
        self.kv_misses = Family(M.KV_PREFIX_MISSES, **f)
        self.decisions = Family(M.DECISIONS, **f)
        self.estimate = Family(M.CONDITIONAL_ESTIMATE, **f)
        self.prefill_queue = Family(M.PREFILL_QUEUE_TOKENS, **f)
        self.cached = Family(M.CACHED_TOKENS, **f)

    def cached_tokens(self, num_tokens: int) -> None:
        self.cached.observe(num_tokens)

    def first_token(self, served_by: str, ttft_s: float) -> None:
        self.ttft.observe(ttft_s, served_by=served_by)

    def token_gap(self, served_by: str, itl_s: float, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.itl.observe(itl_s, served_by=served_by)

    def finished(self, served_by: str, finish_reason: str, e2e_s: float) -> None:
        self.e2e.observe(e2e_s, served_by=served_by)
        self.requests.inc(served_by=served_by, finish_reason=finish_reason)

    def prefill(self, queue_s: float, compute_s: float) -> None:
        self.queue.observe(queue_s, pool="prefill")
        self.prefill_s.observe(compute_s, pool="prefill")

    def kv_handoff(self, num_bytes: int, seconds: float, path: str) -> None:
        self.kv_bytes.observe(num_bytes, path=path)
        self.kv_s.observe(seconds, path=path)

    def kv_handoff_skipped(self, num_bytes: int) -> None:
        self.kv_skipped.inc(num_bytes)

    def kv_prefix_miss(self) -> None:
        self.kv_misses.inc()

    def decision(self, remote: bool, reason: str, estimates: Mapping[str, float]) -> None:
        self.decisions.inc(prefill="remote" if remote else "local", reason=reason)
        for name, value in estimates.items():
            self.estimate.set(value, estimate=name)

    def error(self, stage: str, kind: str) -> None:
        self.errors.inc(stage=stage, kind=kind)

    def load(self, load: Load) -> None:
        self.prefill_queue.set(load.prefill_queue_tokens)


class PrefixCacheMetrics:
    """A pool instance's prefix cache (engine/prefix_cache.py), from its running stats."""

    def __init__(self, pool: str, instance: str) -> None:
        f = {"pool": pool, "instance": instance}
        self.queried, self.hits = Family(M.PREFIX_QUERIED, **f), Family(M.PREFIX_HITS, **f)
        self.evicted, self.used = Family(M.PREFIX_EVICTED, **f), Family(M.PREFIX_USED, **f)
        self.capacity = Family(M.PREFIX_CAPACITY, **f)
        self.last = PrefixCacheStats(0, 1)

    def update(self, stats: PrefixCacheStats) -> None:
        for family, now, before in (
            (self.queried, stats.num_queried_tokens, self.last.num_queried_tokens),
            (self.hits, stats.num_hit_tokens, self.last.num_hit_tokens),
            (self.evicted, stats.num_evicted_blocks, self.last.num_evicted_blocks),
        ):
            if now > before:
                family.inc(now - before)
        self.used.set(stats.used_tokens)
        self.capacity.set(stats.capacity_tokens)
        self.last = dataclasses.replace(stats)


class PrefillMetrics:
    """A prefill instance's cancelled prefills and leased KV bytes (triton/prefill_side.py)."""

    def __init__(self, instance: str) -> None:
        self.cancelled = Family(M.PREFILL_CANCELLED, instance=instance)
        self.leased = Family(M.KV_LEASED_BYTES, instance=instance)

    def prefill_cancelled(self) -> None:
        self.cancelled.inc()

    def leased_bytes(self, num_bytes: int) -> None:
        self.leased.set(float(num_bytes))


class ReplicaMetrics:
    """The orchestrator's remote pools, per replica, refreshed every `interval_s` from their
    ReplicaSets (which count as requests come and go)."""

    def __init__(
        self, replica_sets: Mapping[str, ReplicaSet | None], interval_s: float = 2.0
    ) -> None:
        self.sets = {pool: rs for pool, rs in replica_sets.items() if rs is not None}
        self.requests, self.ejections = Family(M.REPLICA_REQUESTS), Family(M.REPLICA_EJECTIONS)
        self.outstanding, self.up = Family(M.REPLICA_OUTSTANDING), Family(M.REPLICA_UP)
        self.prompt, self.held = Family(M.REPLICA_PROMPT_TOKENS), Family(M.REPLICA_HELD_TOKENS)
        self.blocks, self.events = Family(M.REPLICA_CACHED_BLOCKS), Family(M.REPLICA_EVENTS_UP)
        self.evicted = Family(M.REPLICA_EVICTED_BLOCKS)
        # (pool, address) -> the counts already exported
        self._seen: dict[tuple[str, str], tuple[int, ...]] = {}
        self._exported: dict[str, set[str]] = {}  # pool -> the replicas it last showed
        self.interval_s = interval_s
        self._stop = threading.Event()
        if self.sets:
            threading.Thread(target=self._run, name="replica-metrics", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()

    def refresh(self) -> None:
        for pool, rs in self.sets.items():
            listed = {r.address for r in rs.replicas}
            for address in self._exported.get(pool, set()) - listed:  # left the list (scaled
                labels = {"pool": pool, "replica": address}  # down): not up, nothing on it
                for gauge in (self.outstanding, self.up, self.blocks, self.events):
                    gauge.set(0.0, **labels)
            self._exported[pool] = listed
            for r in rs.replicas:
                labels = {"pool": pool, "replica": r.address}
                counters = (self.requests, self.ejections, self.prompt, self.held, self.evicted)
                counts = (r.requests, r.ejections, r.prompt_tokens, r.held_tokens,
                          r.cache.num_evicted)  # fmt: skip
                seen = self._seen.get((pool, r.address), (0,) * len(counts))
                for family, now, before in zip(counters, counts, seen, strict=True):
                    family.inc(max(now - before, 0), **labels)  # (a view restarts from 0)
                self._seen[(pool, r.address)] = counts
                self.outstanding.set(r.outstanding, **labels)
                self.up.set(0.0 if r.ejected_until else 1.0, **labels)
                self.blocks.set(r.cache.num_blocks, **labels)
                live = r.cache.views and all(v.live for v in r.cache.views)
                self.events.set(1.0 if live else 0.0, **labels)

    def stop(self) -> None:
        self._stop.set()


class DecodeMetrics:
    """One decode instance's gauges, updated after every engine step, and its queue and
    co-located prefill histograms (DecodeService's on_step and on_admit hooks)."""

    def __init__(self, model: str, instance: str) -> None:
        f = {"model": model, "instance": instance}
        self.active, self.batch = Family(M.DECODE_ACTIVE, **f), Family(M.DECODE_BATCH, **f)
        self.waiting, self.kv = Family(M.DECODE_WAITING, **f), Family(M.DECODE_KV_BYTES, **f)
        self.kv_capacity, self.steps = (
            Family(M.DECODE_KV_CAPACITY, **f),
            Family(M.DECODE_STEPS, **f),
        )
        self.shared_steps = Family(M.DECODE_SHARED_STEPS, **f)
        self.queue, self.prefill_s = Family(M.QUEUE), Family(M.PREFILL)
        self.prefix = PrefixCacheMetrics("decode", instance)
        self.last_steps = 0

    def on_shared_step(self) -> None:
        """A step run on one thread beside a computing prefill (engine/cpu_share.py)."""
        self.shared_steps.inc(1)

    def on_step(self, stats: DecodeStats) -> None:
        """Gauges from the engine's stats(); a figure the engine does not know is left out."""
        self.active.set(stats.num_running + stats.num_waiting)
        self.batch.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        for family, value in (
            (self.kv, stats.kv_bytes_reserved),
            (self.kv_capacity, stats.kv_bytes_capacity),
        ):
            if value is not None:
                family.set(value)
        if stats.num_steps is not None:
            self.steps.inc(stats.num_steps - self.last_steps)
            self.last_steps = stats.num_steps
        if stats.prefix_cache is not None:
            self.prefix.update(stats.prefix_cache)

    def on_admit(self, queue_s: float, prefill_s: float | None) -> None:
        self.queue.observe(queue_s, pool="decode")
        if prefill_s is not None:
            self.prefill_s.observe(prefill_s, pool="decode")
