"""A live terminal view of a running disagg server, for users without Grafana.

    disagg status                       # Triton metrics on 127.0.0.1:8002
    disagg status --gateway http://127.0.0.1:9000 --interval 2
    disagg status --planner http://127.0.0.1:9400  # the live planner's decisions too

Every interval it scrapes Triton's metrics port (and the gateway's /metrics) and shows the
pools (queue, executions), decode instances (batch, waiting, KV in use), the prefill queue,
and TTFT / ITL / e2e percentiles and rates over the last interval, from histogram deltas;
KV hand-offs by path, with what they left out because decode held it.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str, default: str = "") -> str:
        return dict(self.labels).get(key, default)


def parse(text: str) -> list[Sample]:
    """Prometheus text format -> samples (comments and malformed lines skipped)."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        out.append(Sample(m.group(1), labels, value))
    return out


def total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.label(k) == v for k, v in labels.items())
    )


def buckets(samples: list[Sample], name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts, summed over its label sets: {le: count}."""
    out: dict[float, float] = defaultdict(float)
    for s in samples:
        if s.name == name + "_bucket":
            out[float(s.label("le"))] += s.value
    return dict(out)


def quantile(q: float, cumulative: dict[float, float]) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding the
    q-th observation; NaN without observations; the last finite bound for the +Inf bucket."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return math.nan
    rank = q * cumulative[bounds[-1]]
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        count = cumulative[b]
        if count >= rank:
            if math.isinf(b):
                return prev_bound
            if count == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = b, count
    return prev_bound


def delta(now: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    return {le: now[le] - before.get(le, 0.0) for le in now}


def _ms(x: float) -> str:
    return "    -" if math.isnan(x) else f"{x * 1e3:5.0f}"


def render(
    before: list[Sample],
    now: list[Sample],
    seconds: float,
    gateway: tuple[list[Sample], list[Sample]] | None = None,  # its (before, now)
    planner: list[Sample] | str | None = None,  # the live planner's /metrics now, or why not
) -> str:
    """One frame: what changed between two scrapes `seconds` apart."""
    lines = [time.strftime("disagg status  %H:%M:%S") + f"   (last {seconds:.0f} s)", ""]
    lines.append("pools           queued  executions/s")
    for model in sorted({s.label("model") for s in now if s.name.startswith("nv_inference")}):
        if not model:
            continue
        pending = total(now, "nv_inference_pending_request_count", model=model)
        execs = total(now, "nv_inference_exec_count", model=model) - total(
            before, "nv_inference_exec_count", model=model
        )
        lines.append(f"  {model:<14}{pending:6.0f}  {execs / seconds:11.1f}")
    # one-thread steps: the share of the last interval's steps run beside a computing
    # prefill on the same cores (engine/cpu_share.py); near 100% the pools want cores apart
    lines += ["", "decode instance   batch  waiting  KV in use              one-thread steps"]
    for s in sorted(
        (s for s in now if s.name == "disagg_decode_batch_size"), key=lambda s: s.labels
    ):
        inst = s.label("instance")
        kv = total(now, "disagg_decode_kv_bytes_in_use", instance=inst)
        cap = total(now, "disagg_decode_kv_bytes_capacity", instance=inst)
        waiting = total(now, "disagg_decode_waiting_sequences", instance=inst)
        use = f"{kv / 2**20:7.1f} MiB ({100 * kv / cap:3.0f}%)" if cap else f"{kv / 2**20:7.1f} MiB"
        steps, shared = (
            total(now, name, instance=inst) - total(before, name, instance=inst)
            for name in ("disagg_decode_steps_total", "disagg_decode_shared_steps_total")
        )
        yielded = f"{shared / steps:.0%}" if steps > 0 else "-"
        lines.append(f"  {inst:<16}{s.value:5.0f}  {waiting:7.0f}  {use:<21}  {yielded:>16}")
    caches = sorted(
        {(s.label("pool"), s.label("instance")) for s in now
         if s.name == "disagg_prefix_cache_capacity_tokens"}
    )  # fmt: skip
    if caches:
        lines += ["", "prefix cache      hit rate (last)  hit rate (all)  in use      evicted"]
        for pool, inst in caches:
            labels = {"pool": pool, "instance": inst}
            hit, asked = (
                total(now, f"disagg_prefix_cache_{n}_tokens_total", **labels)
                for n in ("hit", "queried")
            )
            d_hit = hit - total(before, "disagg_prefix_cache_hit_tokens_total", **labels)
            d_asked = asked - total(before, "disagg_prefix_cache_queried_tokens_total", **labels)
            used = total(now, "disagg_prefix_cache_used_tokens", **labels)
            cap = total(now, "disagg_prefix_cache_capacity_tokens", **labels)
            evicted = total(now, "disagg_prefix_cache_evicted_blocks_total", **labels)
            recent = f"{100 * d_hit / d_asked:5.0f}%" if d_asked else "    -"
            overall = f"{100 * hit / asked:5.0f}%" if asked else "    -"
            lines.append(
                f"  {pool[:7]:<7} {inst[-8:]:<8} {recent:>10}  {overall:>14}  "
                f"{used:6.0f}/{cap:<6.0f} {evicted:7.0f}"
            )
    queued = total(now, "disagg_prefill_queue_tokens")
    lines += ["", f"prefill queue: {queued:.0f} prompt tokens", ""]
    lines.append("latency (ms)     p50    p90    p99     per s")
    for label, name in (
        ("TTFT", "disagg_ttft_seconds"),
        ("ITL", "disagg_itl_seconds"),
        ("e2e", "disagg_e2e_seconds"),
        ("KV hand-off", "disagg_kv_handoff_seconds"),
    ):
        d = delta(buckets(now, name), buckets(before, name))
        n = max(d.values(), default=0.0)
        qs = " ".join(_ms(quantile(q, d)) + " " for q in (0.5, 0.9, 0.99))
        lines.append(f"  {label:<13}{qs} {n / seconds:7.1f}")
    paths = sorted({s.label("path") for s in now if s.name == "disagg_kv_handoff_bytes_count"})
    if paths and paths != [""]:
        lines += ["", "KV hand-off by path   per s    MB/s   p50 ms"]
        for path in paths:
            n = total(now, "disagg_kv_handoff_bytes_count", path=path) - total(
                before, "disagg_kv_handoff_bytes_count", path=path
            )
            mb = total(now, "disagg_kv_handoff_bytes_sum", path=path) - total(
                before, "disagg_kv_handoff_bytes_sum", path=path
            )
            d = delta(
                buckets([x for x in now if x.label("path") == path], "disagg_kv_handoff_seconds"),
                buckets(
                    [x for x in before if x.label("path") == path], "disagg_kv_handoff_seconds"
                ),
            )
            lines.append(
                f"  {path:<18}{n / seconds:7.1f} {mb / 1e6 / seconds:7.1f}  {_ms(quantile(0.5, d))}"
            )
    lines += _left_out(before, now, seconds)
    replicas = sorted(
        (s.label("pool"), s.label("replica"), s.value) for s in now if s.name == "disagg_replica_up"
    )
    if replicas:
        lines += ["", "replicas              up  in flight  requests/s  ejections  blocks"
                  "  held  events"]  # fmt: skip
        for pool, replica, up in replicas:
            labels = {"pool": pool, "replica": replica}
            rate = total(now, "disagg_replica_requests_total", **labels) - total(
                before, "disagg_replica_requests_total", **labels
            )
            # held: of the prompt tokens it was chosen for, those its cache held (the view's)
            prompt = total(now, "disagg_replica_prompt_tokens_total", **labels)
            held = total(now, "disagg_replica_held_tokens_total", **labels)
            events = total(now, "disagg_replica_kv_events_up", **labels)
            lines.append(
                f"  {pool[:7]:<7} {replica:<21} {'yes' if up else 'NO ':<4}"
                f"{total(now, 'disagg_replica_outstanding_requests', **labels):6.0f}"
                f"{rate / seconds:12.1f}"
                f"{total(now, 'disagg_replica_ejections_total', **labels):10.0f}"
                f"{total(now, 'disagg_replica_cached_blocks', **labels):8.0f}"
                f"{f'{held / prompt:.0%}' if prompt else '-':>6}  {'yes' if events else 'no'}"
            )
    decisions = [s for s in now if s.name == "disagg_conditional_decisions_total"]
    if decisions:
        lines += ["", "conditional prefill decisions (total)"]
        lines += [
            f"  {s.label('prefill'):<7}{s.label('reason'):<16}{s.value:8.0f}" for s in decisions
        ]
        learned = {
            s.label("estimate"): s.value for s in now if s.name == "disagg_conditional_estimate"
        }
        if learned:
            lines.append("  decided with: " + ", ".join(f"{k} {v:.3g}" for k, v in learned.items()))
    routes = [s for s in now if s.name == "disagg_router_requests_total"]
    if routes:
        lines += ["", "router (total)"]
        lines += [f"  {s.label('target'):<12}{s.label('reason'):<24}{s.value:8.0f}" for s in routes]
    errors = [s for s in now if s.name == "disagg_errors_total" and s.value]
    if errors:
        lines += ["", "errors (total)"]
        lines += [f"  {s.label('stage'):<10}{s.label('kind'):<18}{s.value:8.0f}" for s in errors]
    if gateway is not None:
        g_before, g_now = gateway
        reqs = total(g_now, "disagg_gateway_requests_total") - total(
            g_before, "disagg_gateway_requests_total"
        )
        inflight = total(g_now, "disagg_gateway_inflight_requests")
        lines += ["", f"gateway: {inflight:.0f} in flight, {reqs / seconds:.1f} requests/s"]
    if isinstance(planner, str):
        lines += ["", f"live planner: unreadable ({planner})"]
    elif planner is not None:
        lines += planner_lines(planner)
    return "\n".join(lines)


def planner_lines(samples: list[Sample]) -> list[str]:
    """What the live planner wants, what it decided (by reason) and what it last saw."""
    wanted = {s.label("pool"): s.value for s in samples if s.name == "disagg_planner_replicas"}
    out = [
        "",
        "live planner: wants " + ", ".join(f"{p} {n:.0f}" for p, n in sorted(wanted.items())),
    ]
    for s in sorted(
        (s for s in samples if s.name == "disagg_planner_decisions_total"), key=lambda s: s.labels
    ):
        out.append(
            f"  {s.label('pool'):<8}{s.label('action'):<5}{s.label('reason'):<10}{s.value:6.0f}"
        )
    seen = {s.label("signal"): s.value for s in samples if s.name == "disagg_planner_signal"}
    if seen:

        def ms(k: str) -> str:
            return _ms(seen.get(k, math.nan)).strip()

        out.append(
            f"  last window: prefill queue p90 {ms('queue_p90_s')} ms, TTFT p90 "
            f"{ms('ttft_p90_s')} ms, prefill busy {seen.get('prefill_busy', 0.0):.2f}, "
            f"ITL p90 {ms('itl_p90_s')} ms, {seen.get('decode_in_flight', 0.0):.0f} decoding"
        )
    return out


def _left_out(before: list[Sample], now: list[Sample], seconds: float) -> list[str]:
    """What hand-offs did not move because decode held it (a conversation's earlier turns),
    and the partial hand-offs decode could not complete (handed off again whole)."""
    skipped, misses = (
        "disagg_kv_handoff_skipped_bytes_total",
        "disagg_kv_handoff_prefix_misses_total",
    )
    if not total(now, skipped) and not total(now, misses):
        return []
    mb = (total(now, skipped) - total(before, skipped)) / 1e6
    return [
        f"  left out (decode held it) {mb / seconds:7.1f} MB/s, {total(now, skipped) / 1e6:.0f} MB "
        f"in all; prefix misses {total(now, misses) - total(before, misses):.0f} "
        f"({total(now, misses):.0f} in all)"
    ]


def scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return parse(r.read().decode())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="disagg status", description=__doc__.split("\n")[0])
    p.add_argument("--metrics", default="http://127.0.0.1:8002/metrics", help="Triton metrics")
    p.add_argument("--gateway", default="", help="gateway base URL (its /metrics is read)")
    p.add_argument("--planner", default="", help="the live planner's base URL (its /metrics)")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    args = p.parse_args(argv)
    gw_url = args.gateway.rstrip("/") + "/metrics" if args.gateway else ""
    try:
        before, gw_before = scrape(args.metrics), scrape(gw_url) if gw_url else None
    except OSError as e:
        print(f"cannot read {args.metrics}: {e}", file=sys.stderr)
        return 1
    while True:
        start = time.monotonic()
        time.sleep(args.interval)
        try:
            now, gw_now = scrape(args.metrics), scrape(gw_url) if gw_url else None
        except OSError as e:
            print(f"\nscrape failed: {e}; retrying", file=sys.stderr)
            continue
        gateway = None if gw_before is None or gw_now is None else (gw_before, gw_now)
        planner: list[Sample] | str | None = None
        if args.planner:
            try:
                planner = scrape(args.planner.rstrip("/") + "/metrics")
            except OSError as e:
                planner = str(e)
        frame = render(before, now, time.monotonic() - start, gateway, planner)
        if args.once:
            print(frame)
            return 0
        sys.stdout.write("\033[H\033[2J" + frame + "\n")  # clear the screen, then draw
        sys.stdout.flush()
        before, gw_before = now, gw_now


if __name__ == "__main__":
    sys.exit(main())
