"""The live planner's decisions from scripted metrics (planner/live.py, autoscale.py): no
server, windows made by hand or from Prometheus text."""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import replace

import pytest
from prometheus_client import generate_latest

from disagg import status as S
from disagg.planner.autoscale import Autoscaler
from disagg.planner.live import DECODE, DOWN, PREFILL, UP, Planner, Targets, Window

pytestmark = pytest.mark.unit
T = Targets(queue_s=1.0, ttft_s=4.0, itl_s=0.5, decode_seqs=8, up_for_s=6, down_for_s=20,
            cooldown_s=30, max_prefill=3, max_decode=3)  # fmt: skip
STEP = 1.0


def busy(queue=3.0, ttft=5.0, busy_s=2.0) -> dict:
    return dict(prefilled=4, queue_p90_s=queue, ttft_p90_s=ttft, prefill_busy_s=busy_s)


def light(busy_s=0.1) -> dict:
    return dict(prefilled=1, queue_p90_s=0.01, ttft_p90_s=0.5, prefill_busy_s=busy_s)


def idle() -> dict:
    return {}  # no request: NaN figures


def run(planner: Planner, seconds: list[dict]):
    """Each second's load (figures per second) -> [(time, decision)]: the windows the
    planner gets are the last up_for_s / down_for_s seconds of it, as the autoscaler's
    scrapes make them (quantiles: the worst second's; work: summed)."""
    out = []
    for i in range(1, len(seconds) + 1):
        t = i * STEP
        out += [(t, d) for d in planner.observe(t, _span(seconds, i, T.up_for_s),
                                                _span(seconds, i, T.down_for_s))]  # fmt: skip
    return out


def _span(seconds: list[dict], i: int, span: float) -> Window | None:
    n = int(span / STEP)
    if i < n:
        return None
    part = seconds[i - n : i]
    worst = lambda k: max((x.get(k, math.nan) for x in part), default=math.nan)  # noqa: E731
    q = [x["queue_p90_s"] for x in part if "queue_p90_s" in x]
    return Window(
        span, end=i * STEP,
        prefilled=sum(x.get("prefilled", 0) for x in part),
        queue_p90_s=max(q) if q else math.nan, ttft_p90_s=worst("ttft_p90_s"),
        prefill_busy_s=sum(x.get("prefill_busy_s", 0.0) for x in part),
        prefill_waiting=sum(x.get("prefill_waiting", 0.0) for x in part) / n,
        itl_p90_s=worst("itl_p90_s"),
        decode_in_flight=sum(x.get("decode_in_flight", 0.0) for x in part) / n,
    )  # fmt: skip


def test_a_queue_held_for_up_for_s_adds_one_prefill_replica_with_its_reason():
    p = Planner(T, prefill=1, decode=1)
    got = run(p, [light()] * 25 + [busy(busy_s=1.0)] * 5)
    [(t, d)] = got
    assert (d.pool, d.action, d.replicas, d.reason) == (PREFILL, UP, 2, "queue")
    assert t == 25 + 1  # the first window that holds a breach
    assert "queue p90 3000 ms" in d.detail and p.replicas(PREFILL) == 2


def test_a_quiet_second_inside_the_window_does_not_hide_a_queue():
    """Requests finish in bursts: seconds without a finished prefill are not calm."""
    p = Planner(T, prefill=1, decode=1)
    got = run(p, ([idle()] * 2 + [busy(busy_s=1.0)]) * 10)
    assert [(d.pool, d.action) for _, d in got] == [(PREFILL, UP)]


def test_prompts_waiting_while_none_finishes_is_a_stall():
    p = Planner(T, prefill=1, decode=1)
    got = run(p, [light()] * 22 + [dict(prefill_waiting=2000.0)] * 7)
    assert [(d.reason, t) for t, d in got] == [("stalled", 22 + 6)]


def test_ttft_alone_is_a_breach_when_the_queue_is_short():
    p = Planner(T, prefill=1, decode=1)
    got = run(p, [busy(queue=0.2, ttft=9.0)] * 8)
    assert [(d.pool, d.reason) for _, d in got] == [(PREFILL, "ttft")]


def test_the_cooldown_spaces_actions_and_max_caps_them():
    p = Planner(T, prefill=1, decode=1)
    got = run(p, [busy(busy_s=1.0)] * 200)
    times = [t for t, d in got if d.pool == PREFILL]
    assert [d.replicas for _, d in got] == [2, 3]  # max_prefill 3
    assert times[1] - times[0] >= T.cooldown_s


def test_calm_load_that_fits_one_fewer_drains_after_down_for_s():
    p = Planner(T, prefill=3, decode=1)
    got = run(p, [light(busy_s=0.5)] * 100)
    downs = [(t, d.replicas, d.reason) for t, d in got if d.pool == PREFILL]
    assert [r for _, r, _ in downs] == [2, 1] and {why for *_, why in downs} == {"idle"}
    assert downs[0][0] == T.down_for_s and downs[1][0] - downs[0][0] >= T.cooldown_s
    assert p.replicas(PREFILL) == 1  # never below min


def test_busy_replicas_are_not_drained_even_with_a_short_queue():
    """0.9 s of prefill per second on 2 replicas would be 90% of one: too busy to drop one."""
    p = Planner(T, prefill=2, decode=1)
    got = run(p, [light(busy_s=0.9)] * 100)
    assert [d for _, d in got if d.pool == PREFILL] == []


def test_an_idle_window_is_calm_not_a_breach():
    p = Planner(T, prefill=2, decode=2)
    got = run(p, [idle()] * 25)
    assert {(d.pool, d.action) for _, d in got} == {(PREFILL, DOWN), (DECODE, DOWN)}


def test_decode_scales_on_sequences_in_flight_and_on_itl():
    p = Planner(T, prefill=1, decode=1)
    got = run(p, [dict(itl_p90_s=0.1, decode_in_flight=12)] * 8)  # 12 > 8 slots
    assert [(d.pool, d.action, d.reason) for _, d in got] == [(DECODE, UP, "in_flight")]
    p = Planner(T, prefill=1, decode=1)
    got = run(p, [dict(itl_p90_s=0.9, decode_in_flight=3)] * 8)
    assert [(d.pool, d.reason) for _, d in got] == [(DECODE, "itl")]


def test_a_window_that_saw_the_old_replica_count_decides_nothing():
    p = Planner(replace(T, cooldown_s=1.0), prefill=1, decode=1)
    [d] = p.observe(10.0, Window(6, end=10.0, **busy()), None)
    assert d.action == UP
    assert p.observe(12.0, Window(6, end=12.0, **busy()), None) == []  # began at 6 < 10
    assert [x.replicas for x in p.observe(16.0, Window(6, end=16.0, **busy()), None)] == [3]


def test_random_load_never_acts_on_a_pool_faster_than_the_cooldown():
    rng = random.Random(7)
    p = Planner(T, prefill=2, decode=2)
    kinds = [busy(busy_s=1.0), light(), idle(), dict(decode_in_flight=30)]
    seconds = [x for _ in range(300) for x in [rng.choice(kinds)] * rng.randrange(1, 15)]
    got = run(p, seconds)
    assert {d.action for _, d in got} == {UP, DOWN}, "random load should move both ways"
    for pool in (PREFILL, DECODE):
        times = [t for t, d in got if d.pool == pool]
        assert all(b - a >= T.cooldown_s for a, b in zip(times, times[1:], strict=False))
    assert all(1 <= d.replicas <= 3 for _, d in got)


def _text_str(queue: dict[float, int], busy_s: float) -> str:
    lines = [
        f'disagg_queue_seconds_bucket{{pool="prefill",le="{le}"}} {n}' for le, n in queue.items()
    ]
    return "\n".join([*lines, f'disagg_prefill_seconds_sum{{pool="prefill"}} {busy_s}'])


def _text(queue: dict[float, int], ttft: dict[float, int], busy_s: float, outstanding: int):
    lines = []
    for le, n in queue.items():
        lines.append(f'disagg_queue_seconds_bucket{{pool="prefill",le="{le}"}} {n}')
    lines.append(f'disagg_queue_seconds_bucket{{pool="decode",le="+Inf"}} {1000 + busy_s}')
    for le, n in ttft.items():
        lines.append(
            f'disagg_ttft_seconds_bucket{{model="orchestrator",served_by="x",le="{le}"}} {n}'
        )
    lines.append(f'disagg_prefill_seconds_sum{{pool="prefill"}} {busy_s}')
    lines.append(f'disagg_prefill_seconds_sum{{pool="decode"}} {busy_s * 7}')
    lines.append(
        f'disagg_replica_outstanding_requests{{pool="decode",replica="a:1"}} {outstanding}'
    )
    lines.append('disagg_replica_outstanding_requests{pool="prefill",replica="b:1"} 50')
    return S.parse("\n".join(lines))


def test_a_window_is_the_change_between_two_scrapes_of_the_prefill_pool_only():
    before = _text({0.5: 10, 1.0: 10, 2.0: 10, math.inf: 10}, {1.0: 5, math.inf: 5}, 3.0, 0)
    now = _text({0.5: 10, 1.0: 11, 2.0: 20, math.inf: 20}, {1.0: 5, 8.0: 15, math.inf: 15},
                7.0, 4)  # fmt: skip
    w = Window.between([before, now], 2.0, end=9.0)
    assert w.prefilled == 10  # the decode pool's queue is not counted
    assert 1.0 < w.queue_p90_s <= 2.0  # 9 of the 10 new ones waited 1-2 s
    assert w.prefill_busy_s == pytest.approx(4.0) and w.start == 7.0
    assert w.decode_in_flight == 4 and w.ttft_p90_s > 4.0


class Recorder:
    def __init__(self):
        self.calls = []

    def set_replicas(self, pool, count):
        self.calls.append((pool, count))


def test_the_autoscaler_windows_scrapes_then_carries_out_records_and_counts(tmp_path):
    scaler = Autoscaler(Planner(T, 1, 1), Recorder(), [], log_path=tmp_path / "d.jsonl")
    got = []
    for i in range(0, 12):  # from t=4 on, 5 prefills a second that each waited 2-4 s
        n = 5 * max(0, i - 4)
        now = _text({1.0: 0, 4.0: n, math.inf: n}, {1.0: 0, math.inf: 0}, 1.0 * n, 0)
        got += [(i, d) for d in scaler.step(now, t=float(i))]
    # t=6: the first scrape 6 s after another; its p90 is the slow prefills' (t=5, 6)
    assert [(i, d.pool, d.replicas) for i, d in got] == [(6, PREFILL, 2)]
    assert scaler.actuator.calls == [(PREFILL, 2)]
    [line] = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert line["pool"] == PREFILL and line["action"] == UP and line["reason"] == "queue"
    samples = S.parse(generate_latest(scaler.metrics.registry).decode())
    assert S.total(samples, "disagg_planner_decisions_total", pool="prefill", action="up") == 1
    assert S.total(samples, "disagg_planner_replicas", pool="prefill") == 2
    assert S.total(samples, "disagg_planner_signal", signal="prefill_busy") == pytest.approx(5.0)
    assert len(scaler.history) <= int(T.down_for_s) + 2  # old scrapes are let go


def _tagged(text: str, frontend: str) -> list[S.Sample]:
    return [S.Sample(x.name, tuple(sorted((*x.labels, ("frontend", frontend)))), x.value)
            for x in S.parse(text)]  # fmt: skip


def test_observed_replica_counts_follow_the_frontends_each_replica_once():
    """Kubernetes: two frontends see the same three decode replicas up (one ejected): 3, not
    6; and nothing is published before the frontends were read (an HPA would act on it)."""
    scaler = Autoscaler(Planner(T, 1, 1), Recorder(), [], observe=True)
    assert "disagg_planner_replicas{" not in generate_latest(scaler.metrics.registry).decode()
    up = "\n".join(f'disagg_replica_up{{pool="decode",replica="d{i}:1"}} {int(i < 3)}'
                   for i in range(4))  # fmt: skip
    scaler.step(_tagged(up, "a") + _tagged(up, "b"), t=0.0)
    assert scaler.planner.replicas(DECODE) == 3 and scaler.planner.replicas(PREFILL) == 1
    samples = S.parse(generate_latest(scaler.metrics.registry).decode())
    assert S.total(samples, "disagg_planner_replicas", pool="decode") == 3


def test_a_frontend_that_came_in_the_window_adds_no_history_of_its_own():
    old = {1.0: 0, 4.0: 10, math.inf: 10}
    before = _tagged(_text_str(old, 10.0), "a")
    now = _tagged(_text_str({1.0: 0, 4.0: 12, math.inf: 12}, 12.0), "a") + _tagged(
        _text_str({1.0: 0, 4.0: 900, math.inf: 900}, 900.0), "b"
    )
    w = Window.between([before, now], 2.0)
    assert w.prefilled == 2 and w.prefill_busy_s == pytest.approx(2.0)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--cooldown-s", "0"], "--cooldown-s"),
        (["--queue-ms", "nan"], "--queue-ms"),
        (["--max-prefill", "-1"], "--max-prefill"),
        (["--planner-interval-s", "0"], "--planner-interval-s"),
        (["--min-decode", "3", "--max-decode", "2"], "--min is above its --max"),
    ],
)
def test_bad_planner_settings_are_refused_with_what_is_wrong(args, says):
    import argparse

    from disagg.planner.autoscale import add_target_args, targets_from

    p = argparse.ArgumentParser()
    add_target_args(p)
    with pytest.raises(SystemExit, match=says):
        targets_from(p.parse_args(args))


def test_disagg_status_shows_what_the_planner_wants_decided_and_saw():
    scaler = Autoscaler(Planner(T, 1, 1), Recorder(), [])
    for i in range(0, 8):
        n = 5 * max(0, i - 4)
        now = _text({1.0: 0, 4.0: n, math.inf: n}, {1.0: 0, math.inf: 0}, 1.0 * n, 0)
        scaler.step(now, t=float(i))
    exposed = S.parse(generate_latest(scaler.metrics.registry).decode())
    frame = S.render([], [], 2.0, planner=exposed)
    assert "live planner: wants decode 1, prefill 2" in frame
    assert re.search(r"prefill\s+up\s+queue\s+1\b", frame), frame
    assert re.search(r"prefill queue p90 \d+ ms", frame), frame
    assert "live planner: unreadable (refused)" in S.render([], [], 2.0, planner="refused")


@pytest.mark.parametrize("source", ["127.0.0.1:8002/metrics", "dns:frontend", "dns::8002"])
def test_a_metrics_source_that_is_neither_a_url_nor_a_dns_name_is_refused(source):
    from disagg.planner.autoscale import check_sources

    with pytest.raises(SystemExit, match="expected an http"):
        check_sources([source])
    check_sources(["http://127.0.0.1:8002/metrics", "dns:disagg-frontend-pods:8002"])


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--prefill", "11"], "--prefill 0..10"),
        (["--decode", "0"], "--decode 1..10"),
        (["--autoscale", "--prefill", "3", "--max-prefill", "2"], "within the planner's"),
        (["--autoscale", "--max-decode", "12"], "at most 10 servers"),
    ],
)
def test_disagg_cluster_refuses_pool_sizes_it_cannot_run_before_starting_anything(
    argv, says, capsys
):
    from disagg.serve import cluster

    with pytest.raises(SystemExit) as e:
        cluster.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
