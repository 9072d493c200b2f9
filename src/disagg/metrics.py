"""Every Prometheus metric disagg exports, defined once: name, kind, help, labels, buckets.

The Triton models publish theirs on Triton's metrics port (`pb_utils.MetricFamily`, see
triton/pb.py), the gateway on its own /metrics; the Grafana dashboard, the status view and
the tests read these names from here. Labels come from small closed sets (model, pool,
served_by, reasons, error kinds), never request ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

# Bucket upper bounds, in seconds or bytes. Wide: a 135M model on 2 cores and a 70B model on
# GPUs both land inside.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 300)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16)
KV_BYTES_BUCKETS = tuple(float(1 << s) for s in range(16, 33, 2))  # 64 KiB .. 4 GiB
KV_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


def _m(
    name: str, kind: str, help_: str, labels: Iterable[str] = (), buckets: Iterable[float] = ()
) -> Metric:
    return Metric(name, kind, help_, tuple(labels), tuple(float(b) for b in buckets))


# ------------------------------------------------------------------ orchestrator (Triton)
TTFT = _m(
    "disagg_ttft_seconds",
    HISTOGRAM,
    "Time to first token, orchestrator receipt to first token",
    ("model", "served_by"),
    TTFT_BUCKETS,
)
ITL = _m(
    "disagg_itl_seconds",
    HISTOGRAM,
    "Inter-token latency: gap between a request's tokens after the first",
    ("model", "served_by"),
    ITL_BUCKETS,
)
E2E = _m(
    "disagg_e2e_seconds",
    HISTOGRAM,
    "End-to-end latency of finished requests, receipt to last token",
    ("model", "served_by"),
    E2E_BUCKETS,
)
REQUESTS = _m(
    "disagg_requests_total",
    COUNTER,
    "Finished requests by who prefilled them and why they ended",
    ("model", "served_by", "finish_reason"),
)
ERRORS = _m(
    "disagg_errors_total",
    COUNTER,
    "Failures by stage (request, prefill, decode, kv_handoff) and kind",
    ("model", "stage", "kind"),
)
QUEUE = _m(
    "disagg_queue_seconds",
    HISTOGRAM,
    "Wait before prefill began: in the prefill pool's queue, or decode's waiting queue",
    ("pool",),
    QUEUE_BUCKETS,
)
PREFILL = _m(
    "disagg_prefill_seconds",
    HISTOGRAM,
    "Prefill compute time, in the prefill pool or inside decode (co-located)",
    ("pool",),
    PREFILL_BUCKETS,
)
KV_BYTES = _m(
    "disagg_kv_handoff_bytes",
    HISTOGRAM,
    "Size of the KV payload handed from prefill to decode, by path (shm: within one server; "
    "network: pulled by a decode server from a prefill server; trtllm: TensorRT-LLM's own)",
    ("model", "path"),
    KV_BYTES_BUCKETS,
)
KV_SECONDS = _m(
    "disagg_kv_handoff_seconds",
    HISTOGRAM,
    "KV hand-off time: serialise, transfer, verify and import into decode, by path",
    ("model", "path"),
    KV_SECONDS_BUCKETS,
)
KV_SKIPPED_BYTES = _m(
    "disagg_kv_handoff_skipped_bytes_total",
    COUNTER,
    "Prompt K/V bytes hand-offs left out because decode held them in its prefix cache (a "
    "conversation's earlier turns); what moved is disagg_kv_handoff_bytes",
    ("model",),
)
KV_PREFIX_MISSES = _m(
    "disagg_kv_handoff_prefix_misses_total",
    COUNTER,
    "Partial hand-offs decode could not complete from its prefix cache (evicted, restarted), "
    "handed off again with the whole prompt's K/V",
    ("model",),
)
KV_LEASED_BYTES = _m(
    "disagg_kv_leased_bytes",
    GAUGE,
    "KV payload bytes a prefill instance holds for decode servers to pull (kvnet.py): freed "
    "on pull, on a drop (the client left first) or after kv_lease_s",
    ("instance",),
)
PREFILL_CANCELLED = _m(
    "disagg_prefill_cancelled_total",
    COUNTER,
    "Prefills stopped before their end because the request's client went away",
    ("instance",),
)
DECISIONS = _m(
    "disagg_conditional_decisions_total",
    COUNTER,
    "Conditional mode: where each prompt was prefilled, and the cost model's reason",
    ("model", "prefill", "reason"),
)
CONDITIONAL_ESTIMATE = _m(
    "disagg_conditional_estimate",
    GAUGE,
    "Conditional mode: what the cost model has learned and decides with (remote_stall: the "
    "share of a remote prefill that still slows decode; prefill seconds per token and fixed "
    "seconds on each side; hand-off seconds per token)",
    ("model", "estimate"),
)
CACHED_TOKENS = _m(
    "disagg_request_cached_tokens",
    HISTOGRAM,
    "Prompt tokens of each finished request that a prefix cache gave (OpenAI cached_tokens)",
    ("model",),
    (0, 16, 64, 256, 512, 1024, 2048, 4096),
)
PREFILL_QUEUE_TOKENS = _m(
    "disagg_prefill_queue_tokens",
    GAUGE,
    "Prompt tokens the orchestrator has sent to the prefill pool and not yet got back",
    ("model",),
)

# ------------------------------------------------------------------ remote pools (orchestrator)
REPLICA_REQUESTS = _m(
    "disagg_replica_requests_total",
    COUNTER,
    "Requests this frontend sent to each replica of a remote pool",
    ("pool", "replica"),
)
REPLICA_OUTSTANDING = _m(
    "disagg_replica_outstanding_requests",
    GAUGE,
    "Requests this frontend has in flight on each replica (what replicas are chosen by)",
    ("pool", "replica"),
)
REPLICA_EJECTIONS = _m(
    "disagg_replica_ejections_total",
    COUNTER,
    "Times a replica left rotation after a failed connection",
    ("pool", "replica"),
)
REPLICA_UP = _m(
    "disagg_replica_up",
    GAUGE,
    "1 while a replica is in rotation, 0 while it is ejected",
    ("pool", "replica"),
)
REPLICA_PROMPT_TOKENS = _m(
    "disagg_replica_prompt_tokens_total",
    COUNTER,
    "Prompt tokens of the requests this frontend chose each replica for by its cache",
    ("pool", "replica"),
)
REPLICA_HELD_TOKENS = _m(
    "disagg_replica_held_tokens_total",
    COUNTER,
    "Of those, the leading tokens the replica held when chosen, by this frontend's view",
    ("pool", "replica"),
)
REPLICA_CACHED_BLOCKS = _m(
    "disagg_replica_cached_blocks",
    GAUGE,
    "Prefix cache blocks each replica holds, by this frontend's view (its KV events, or "
    "what this frontend sent it)",
    ("pool", "replica"),
)
REPLICA_EVICTED_BLOCKS = _m(
    "disagg_replica_evicted_blocks_total",
    COUNTER,
    "Prefix cache blocks each replica evicted, as its KV events told this frontend",
    ("pool", "replica"),
)
REPLICA_EVENTS_UP = _m(
    "disagg_replica_kv_events_up",
    GAUGE,
    "1 while this frontend follows the replica's KV events (every instance), else 0",
    ("pool", "replica"),
)

# ------------------------------------------------------------------ decode pool (Triton)
DECODE_ACTIVE = _m(
    "disagg_decode_active_sequences",
    GAUGE,
    "Sequences in the decode engine (running + waiting for a slot)",
    ("model", "instance"),
)
DECODE_BATCH = _m(
    "disagg_decode_batch_size",
    GAUGE,
    "Sequences in the last decode step's batch",
    ("model", "instance"),
)
DECODE_WAITING = _m(
    "disagg_decode_waiting_sequences",
    GAUGE,
    "Sequences waiting for a decode slot or KV budget",
    ("model", "instance"),
)
DECODE_KV_BYTES = _m(
    "disagg_decode_kv_bytes_in_use",
    GAUGE,
    "KV cache bytes reserved by running sequences",
    ("model", "instance"),
)
DECODE_KV_CAPACITY = _m(
    "disagg_decode_kv_bytes_capacity",
    GAUGE,
    "KV cache bytes the decode instance can reserve in all",
    ("model", "instance"),
)
DECODE_STEPS = _m(
    "disagg_decode_steps_total",
    COUNTER,
    "Decode steps run (each produces one token per running sequence)",
    ("model", "instance"),
)
DECODE_SHARED_STEPS = _m(
    "disagg_decode_shared_steps_total",
    COUNTER,
    "Decode steps run on one thread because a prefill computed on the same CPU cores",
    ("model", "instance"),
)

# ------------------------------------------------------------------ prefix caches (each pool)
# hit rate = hit / queried tokens; the pool label is prefill or decode
PREFIX_QUERIED = _m(
    "disagg_prefix_cache_queried_tokens_total",
    COUNTER,
    "Prompt tokens in whole blocks looked up in a pool instance's prefix cache",
    ("pool", "instance"),
)
PREFIX_HITS = _m(
    "disagg_prefix_cache_hit_tokens_total",
    COUNTER,
    "Of those, tokens found cached: their K/V copied, not computed",
    ("pool", "instance"),
)
PREFIX_EVICTED = _m(
    "disagg_prefix_cache_evicted_blocks_total",
    COUNTER,
    "Cached blocks evicted (least recently used first) to make room",
    ("pool", "instance"),
)
PREFIX_USED = _m(
    "disagg_prefix_cache_used_tokens",
    GAUGE,
    "Tokens the prefix cache holds now (whole blocks)",
    ("pool", "instance"),
)
PREFIX_CAPACITY = _m(
    "disagg_prefix_cache_capacity_tokens",
    GAUGE,
    "Tokens the prefix cache may hold (prefix_cache_tokens, in whole blocks)",
    ("pool", "instance"),
)

# ------------------------------------------------------------------ router (Triton)
ROUTER_REQUESTS = _m(
    "disagg_router_requests_total",
    COUNTER,
    "Requests served, by policy target and reason",
    ("target", "reason"),
)
ROUTER_FALLBACKS = _m(
    "disagg_router_fallbacks_total",
    COUNTER,
    "Requests whose planned external target could not serve them, by cause",
    ("target", "cause"),
)
ROUTER_RETRIES = _m(
    "disagg_router_retries_total",
    COUNTER,
    "Requests passed on to the next endpoint of a pool after one failed",
    ("endpoint",),
)
ROUTER_ENDPOINT_ERRORS = _m(
    "disagg_router_endpoint_errors_total",
    COUNTER,
    "Failed calls to external endpoints, by kind",
    ("endpoint", "kind"),
)

# ------------------------------------------------------------------ gateway (its /metrics)
GATEWAY_REQUESTS = _m(
    "disagg_gateway_requests_total",
    COUNTER,
    "Gateway requests by API, model and HTTP status",
    ("api", "model", "status"),
)
GATEWAY_TTFT = _m(
    "disagg_gateway_ttft_seconds",
    HISTOGRAM,
    "Time to first token as the gateway's clients see it (streaming requests)",
    ("model",),
    TTFT_BUCKETS,
)
GATEWAY_E2E = _m(
    "disagg_gateway_e2e_seconds",
    HISTOGRAM,
    "Gateway request latency, body read to last byte",
    ("api", "model"),
    E2E_BUCKETS,
)
GATEWAY_RETRIES = _m(
    "disagg_gateway_retries_total",
    COUNTER,
    "Requests retried because Triton could not be reached",
)
GATEWAY_ERRORS = _m(
    "disagg_gateway_errors_total",
    COUNTER,
    "Gateway error responses by kind (OpenAI error type / code)",
    ("kind",),
)
GATEWAY_INFLIGHT = _m(
    "disagg_gateway_inflight_requests",
    GAUGE,
    "Requests the gateway is serving now",
)
GATEWAY_HELD = _m(
    "disagg_gateway_held_requests",
    GAUGE,
    "Requests held back, not yet in flight, while Triton is replaced (a planned restart)",
)

# ------------------------------------------------------------------ live planner (its /metrics)
PLANNER_DECISIONS = _m(
    "disagg_planner_decisions_total",
    COUNTER,
    "Replicas the live planner added (up) or drained (down), by pool and reason",
    ("pool", "action", "reason"),
)
PLANNER_REPLICAS = _m(
    "disagg_planner_replicas",
    GAUGE,
    "Replicas of each pool the live planner wants (for an HPA: its desired count)",
    ("pool",),
)
PLANNER_SIGNAL = _m(
    "disagg_planner_signal",
    GAUGE,
    "What the live planner saw over its last interval (queue_p90_s, ttft_p90_s, "
    "prefill_busy, itl_p90_s, decode_in_flight; NaN: no observation)",
    ("signal",),
)

ALL = tuple(v for v in dict(globals()).values() if isinstance(v, Metric))


def series_names(m: Metric) -> tuple[str, ...]:
    """The names a metric's samples carry in the Prometheus text format."""
    if m.kind == HISTOGRAM:
        return (m.name + "_bucket", m.name + "_sum", m.name + "_count")
    return (m.name,)
