"""The gateway's Prometheus metrics (prometheus_client, a registry of its own), served at
/metrics. Names and buckets come from disagg.metrics; labels stay low-cardinality: the API
("chat" / "completion"), the public model name as the registry resolved it (unknown names
are "unknown"), the HTTP status."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from disagg import metrics as M

CONTENT_TYPE = CONTENT_TYPE_LATEST
# *_created series: noise for these dashboards (the ignore: prometheus_client leaves it
# unannotated)
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]


def _name(m: M.Metric) -> str:
    # prometheus_client appends _total to counters itself
    return m.name.removesuffix("_total")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            _name(M.GATEWAY_REQUESTS), M.GATEWAY_REQUESTS.help, M.GATEWAY_REQUESTS.labels,
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            _name(M.GATEWAY_TTFT), M.GATEWAY_TTFT.help, M.GATEWAY_TTFT.labels,
            buckets=M.GATEWAY_TTFT.buckets, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            _name(M.GATEWAY_E2E), M.GATEWAY_E2E.help, M.GATEWAY_E2E.labels,
            buckets=M.GATEWAY_E2E.buckets, registry=r,
        )  # fmt: skip
        self.retries = Counter(_name(M.GATEWAY_RETRIES), M.GATEWAY_RETRIES.help, registry=r)
        self.errors = Counter(
            _name(M.GATEWAY_ERRORS), M.GATEWAY_ERRORS.help, M.GATEWAY_ERRORS.labels, registry=r
        )
        self.inflight = Gauge(_name(M.GATEWAY_INFLIGHT), M.GATEWAY_INFLIGHT.help, registry=r)
        self.held = Gauge(_name(M.GATEWAY_HELD), M.GATEWAY_HELD.help, registry=r)

    def finished(self, api: str, model: str, status: int, seconds: float) -> None:
        self.requests.labels(api, model, str(status)).inc()
        if status < 400:
            self.e2e.labels(api, model).observe(seconds)

    def error(self, kind: str) -> None:
        self.errors.labels(kind or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
