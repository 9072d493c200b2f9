"""The live status view: Prometheus parsing, histogram quantiles, one rendered frame."""

from __future__ import annotations

import math

import pytest

from disagg.status import buckets, delta, parse, quantile, render, total

pytestmark = pytest.mark.unit

BEFORE = """
# HELP disagg_ttft_seconds Time to first token
# TYPE disagg_ttft_seconds histogram
disagg_ttft_seconds_bucket{model="orchestrator",served_by="colocated",le="0.1"} 0
disagg_ttft_seconds_bucket{model="orchestrator",served_by="colocated",le="0.5"} 0
disagg_ttft_seconds_bucket{model="orchestrator",served_by="colocated",le="1"} 0
disagg_ttft_seconds_bucket{model="orchestrator",served_by="colocated",le="+Inf"} 0
nv_inference_exec_count{model="prefill",version="1"} 10
nv_inference_pending_request_count{model="prefill",version="1"} 0
"""

NOW = """
disagg_ttft_seconds_bucket{model="orchestrator",served_by="colocated",le="0.1"} 2
disagg_ttft_seconds_bucket{model="orchestrator",served_by="colocated",le="0.5"} 6
disagg_ttft_seconds_bucket{model="orchestrator",served_by="colocated",le="1"} 8
disagg_ttft_seconds_bucket{model="orchestrator",served_by="colocated",le="+Inf"} 10
disagg_ttft_seconds_bucket{model="orchestrator",served_by="disaggregated",le="0.1"} 0
disagg_ttft_seconds_bucket{model="orchestrator",served_by="disaggregated",le="0.5"} 0
disagg_ttft_seconds_bucket{model="orchestrator",served_by="disaggregated",le="1"} 0
disagg_ttft_seconds_bucket{model="orchestrator",served_by="disaggregated",le="+Inf"} 0
nv_inference_exec_count{model="prefill",version="1"} 30
nv_inference_pending_request_count{model="prefill",version="1"} 3
disagg_decode_batch_size{instance="decode_0_0",model="decode"} 5
disagg_decode_waiting_sequences{instance="decode_0_0",model="decode"} 1
disagg_decode_kv_bytes_in_use{instance="decode_0_0",model="decode"} 104857600
disagg_decode_kv_bytes_capacity{instance="decode_0_0",model="decode"} 419430400
disagg_conditional_decisions_total{model="orchestrator",prefill="remote",reason="protect_decode"} 4
disagg_conditional_estimate{model="orchestrator",estimate="remote_stall"} 0.25
garbage line without a value
"""


def test_parse_reads_names_labels_and_values_and_skips_the_rest():
    samples = parse(NOW)
    assert total(samples, "nv_inference_pending_request_count", model="prefill") == 3
    assert total(samples, "disagg_ttft_seconds_bucket", le="+Inf") == 10
    assert all(s.name != "garbage" for s in samples)


def test_quantiles_interpolate_inside_buckets_like_prometheus():
    d = delta(
        buckets(parse(NOW), "disagg_ttft_seconds"), buckets(parse(BEFORE), "disagg_ttft_seconds")
    )
    assert d == {0.1: 2, 0.5: 6, 1.0: 8, math.inf: 10}
    assert quantile(0.5, d) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)  # rank 5 in (0.1, 0.5]
    assert quantile(0.1, d) == pytest.approx(0.05)  # rank 1 in (0, 0.1]
    assert quantile(0.95, d) == 1.0  # in the +Inf bucket: the last finite bound
    assert math.isnan(quantile(0.5, {0.1: 0, math.inf: 0}))


def test_a_frame_shows_pools_decode_and_recent_latency():
    frame = render(parse(BEFORE), parse(NOW), 10.0)
    assert "prefill" in frame and "2.0" in frame  # 20 executions in 10 s
    assert "decode_0_0" in frame and "100.0 MiB ( 25%)" in frame
    ttft = next(line for line in frame.splitlines() if line.strip().startswith("TTFT"))
    # p50 in (0.1, 0.5]; p90 and p99 fall in the +Inf bucket: its lower bound, 1 s
    assert ttft.split()[1:4] == ["400", "1000", "1000"]
    assert "protect_decode" in frame
    assert "decided with: remote_stall 0.25" in frame


def test_a_frame_shows_the_share_of_decode_steps_run_beside_a_prefill():
    labels = '{instance="decode_0_0",model="decode"}'
    before = BEFORE + f"disagg_decode_steps_total{labels} 100\n"
    before += f"disagg_decode_shared_steps_total{labels} 10\n"
    now = NOW + f"disagg_decode_steps_total{labels} 300\n"
    now += f"disagg_decode_shared_steps_total{labels} 60\n"
    row = next(x for x in render(parse(before), parse(now), 10.0).splitlines() if "decode_0_0" in x)
    assert row.split()[-1] == "25%"  # 50 of the last 200 steps
    idle = next(x for x in render(parse(now), parse(now), 10.0).splitlines() if "decode_0_0" in x)
    assert idle.split()[-1] == "-"  # no step in the interval


def test_a_frame_shows_what_hand_offs_left_out_and_the_prefix_misses():
    before = BEFORE + 'disagg_kv_handoff_skipped_bytes_total{model="orchestrator"} 1e6\n'
    now = NOW + (
        'disagg_kv_handoff_bytes_count{model="orchestrator",path="shm"} 4\n'
        'disagg_kv_handoff_bytes_sum{model="orchestrator",path="shm"} 2e6\n'
        'disagg_kv_handoff_skipped_bytes_total{model="orchestrator"} 31e6\n'
        'disagg_kv_handoff_prefix_misses_total{model="orchestrator"} 2\n'
    )
    line = next(x for x in render(parse(before), parse(now), 10.0).splitlines() if "left out" in x)
    assert "3.0 MB/s, 31 MB in all" in line and "prefix misses 2 (2 in all)" in line
    assert not any("left out" in x for x in render(parse(BEFORE), parse(NOW), 10.0).splitlines())


def test_a_frame_shows_what_each_replica_holds_by_the_frontends_view():
    labels = '{pool="decode",replica="10.0.0.6:8001"}'
    now = parse(
        f"disagg_replica_up{labels} 1\n"
        f"disagg_replica_requests_total{labels} 12\n"
        f"disagg_replica_cached_blocks{labels} 340\n"
        f"disagg_replica_prompt_tokens_total{labels} 4000\n"
        f"disagg_replica_held_tokens_total{labels} 3000\n"
        f"disagg_replica_kv_events_up{labels} 1\n"
        'disagg_replica_up{pool="prefill",replica="10.0.0.5:8001"} 1\n'
    )
    frame = render(now, now, 1.0)
    decode = next(line for line in frame.splitlines() if "10.0.0.6:8001" in line)
    assert decode.split()[-3:] == ["340", "75%", "yes"]
    prefill = next(line for line in frame.splitlines() if "10.0.0.5:8001" in line)
    assert prefill.split()[-3:] == ["0", "-", "no"]  # chosen by load alone, no events
