"""Metrics move as the requests they count, on a real tritonserver in the conditional mode
(which serves both ways: decode prefills when it is idle, the prefill pool when it is busy)."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.triton_server import eventually, metric, start_server

from disagg import contracts as C
from disagg.client import GenerateError, GrpcClient, HttpClient
from disagg.engine.config import load_model_args

pytestmark = pytest.mark.integration

HISTOGRAMS = ("disagg_ttft_seconds", "disagg_e2e_seconds", "disagg_itl_seconds")


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    srv = start_server(engine_dir, tmp_path_factory.mktemp("metrics"), mode="conditional")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    return HttpClient(server.endpoints.http, timeout_s=120)


def snapshot(server, names: dict[str, dict]) -> dict[str, float]:
    return {
        key: metric(server, spec["name"], **spec.get("labels", {})) for key, spec in names.items()
    }


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def run(http, prompt_ids: list[int], max_tokens: int) -> dict:
    r = http.generate(
        "orchestrator", {C.INPUT_IDS: prompt_ids, C.MAX_TOKENS: max_tokens, C.IGNORE_EOS: True}
    )
    assert r.finish_reason == "length"
    return r.extra


def keep_decode_busy(server, done: threading.Event, out: dict) -> None:
    client = GrpcClient(server.endpoints.grpc, timeout_s=120)
    try:
        # 512 tokens (the server's limit): over 10 s of decode here, twice what the test needs
        inputs = {C.INPUT_IDS: [1, 2, 3], C.MAX_TOKENS: 512, C.IGNORE_EOS: True}
        out["finish_reason"] = client.generate("orchestrator", inputs, cancel=done).finish_reason
    finally:
        client.close()


def test_idle_decode_prefills_locally_and_every_histogram_counts_each_request(server, http):
    local = {"served_by": "colocated"}
    names = {
        "ttft": {"name": "disagg_ttft_seconds_count", "labels": local},
        "e2e": {"name": "disagg_e2e_seconds_count", "labels": local},
        "itl": {"name": "disagg_itl_seconds_count", "labels": local},
        "done": {"name": "disagg_requests_total", "labels": {**local, "finish_reason": "length"}},
        "idle": {
            "name": "disagg_conditional_decisions_total",
            "labels": {"prefill": "local", "reason": "decode_idle"},
        },
        "queue": {"name": "disagg_queue_seconds_count", "labels": {"pool": "decode"}},
        "prefill": {"name": "disagg_prefill_seconds_count", "labels": {"pool": "decode"}},
        "kv": {"name": "disagg_kv_handoff_bytes_count"},
    }
    before = snapshot(server, names)
    lengths = [3, 7, 5]
    for n in lengths:
        assert run(http, [1, 2, 3, 4, 5], n)["served_by"] == "colocated"

    def check():
        after = snapshot(server, names)
        delta = {k: after[k] - before[k] for k in names}
        assert delta["ttft"] == delta["e2e"] == delta["done"] == delta["idle"] == len(lengths)
        assert delta["itl"] == sum(n - 1 for n in lengths)  # every token after the first
        assert delta["queue"] == delta["prefill"] == len(lengths)
        assert delta["kv"] == 0  # nothing was handed off

    eventually(check)
    # the histograms' sums are in seconds and plausible: TTFT under e2e
    assert 0 < metric(server, "disagg_ttft_seconds_sum") < metric(server, "disagg_e2e_seconds_sum")


def test_busy_decode_sends_a_long_prompt_to_the_prefill_pool_and_counts_its_kv(
    server, http, engine_dir
):
    """The first long prompt is decided on the cost model's priors (nothing in this module
    taught it remote or long local prefills), which send it away from a busy decode. The
    second is decided on what the first taught it (prefill speed and hand-off cost measured
    on this machine under its current load), so it may go either way: the metrics must
    count it the way it went."""
    names = {
        "kv_n": {"name": "disagg_kv_handoff_bytes_count"},
        "kv_bytes": {"name": "disagg_kv_handoff_bytes_sum"},
        "kv_s": {"name": "disagg_kv_handoff_seconds_count"},
        "remote": {
            "name": "disagg_conditional_decisions_total",
            "labels": {"prefill": "remote", "reason": "protect_decode"},
        },
        "local": {"name": "disagg_conditional_decisions_total", "labels": {"prefill": "local"}},
        "prefill": {"name": "disagg_prefill_seconds_count", "labels": {"pool": "prefill"}},
        "queue": {"name": "disagg_queue_seconds_count", "labels": {"pool": "prefill"}},
        "ttft": {"name": "disagg_ttft_seconds_count", "labels": {"served_by": "disaggregated"}},
        "shared": {"name": "disagg_decode_shared_steps_total"},
    }
    before = snapshot(server, names)
    # decode stays busy until both long prompts are decided: a stream long enough to outlast
    # them, cancelled once they are done (a fixed-length one raced them on a slower machine)
    done, busy = threading.Event(), {}
    background = threading.Thread(target=keep_decode_busy, args=(server, done, busy))
    background.start()
    wait_for(lambda: metric(server, "disagg_decode_batch_size") >= 1)
    assert metric(server, "disagg_decode_kv_bytes_in_use") > 0
    long_prompt = [100 + (i * 37) % 5000 for i in range(700)]
    try:
        replies = [run(http, long_prompt, 3) for _ in range(2)]
    finally:
        done.set()
        background.join()
    assert busy["finish_reason"] == "cancelled", busy  # it was still decoding throughout
    served = [r["served_by"] for r in replies]
    assert served[0] == "disaggregated"
    assert served[1] in ("disaggregated", "colocated")
    remote = [r for r in replies if r["served_by"] == "disaggregated"]

    def check():
        after = snapshot(server, names)
        delta = {k: after[k] - before[k] for k in names}
        assert delta["remote"] == delta["kv_n"] == delta["kv_s"] == len(remote)
        # the background stream was decided too (decode idle then: local)
        assert delta["local"] == 1 + len(replies) - len(remote)
        assert delta["prefill"] == delta["queue"] == delta["ttft"] == len(remote)
        # the metric counts the payloads (K/V + header), which went through /dev/shm files:
        # the first whole, a second only what decode's prefix cache lacked
        assert 700 * per_token <= delta["kv_bytes"] < n * (700 * per_token + 4096)
        # the stream stepped on one thread while the prefill process computed beside it on
        # this server's cores (engine/cpu_share.py)
        assert delta["shared"] >= 1

    per_token, n = load_model_args(engine_dir).kv_bytes_per_token, len(remote)
    eventually(check)
    # only a reference to each passed through the orchestrator (kvshm.py)
    assert all(0 < r["kv_bytes"] < 1024 for r in remote)
    # everything finished (the background stream cancelled): the gauges come back down
    wait_for(lambda: metric(server, "disagg_decode_active_sequences") == 0)
    wait_for(lambda: metric(server, "disagg_decode_kv_bytes_in_use") == 0)
    assert metric(server, "disagg_prefill_queue_tokens") == 0


def test_refused_requests_are_counted_by_kind(server, http):
    labels = {"stage": "request", "kind": "invalid_request"}
    before = metric(server, "disagg_errors_total", **labels)
    with pytest.raises(GenerateError, match="max_tokens"):
        http.generate("orchestrator", {C.INPUT_IDS: [1, 2, 3], C.MAX_TOKENS: 100_000})
    eventually(lambda: _equal(metric(server, "disagg_errors_total", **labels), before + 1))


def test_decode_steps_counter_follows_tokens(server, http):
    before = metric(server, "disagg_decode_steps_total")
    shared = metric(server, "disagg_decode_shared_steps_total")
    run(http, [1, 2, 3], 6)
    # alone in decode, prefilled there: the step that prefills also decodes the second token
    eventually(lambda: _equal(metric(server, "disagg_decode_steps_total") - before, 6 - 1))
    # no prefill computed beside it: every step had every thread
    assert metric(server, "disagg_decode_shared_steps_total") == shared


def _equal(a, b) -> None:
    assert a == b, (a, b)


def test_status_view_shows_pools_decode_and_recent_latency(server, http, capsys):
    from disagg import status

    before = status.scrape(server.endpoints.metrics)
    count = metric(server, "disagg_ttft_seconds_count")
    run(http, [1, 2, 3], 4)
    wait_for(lambda: metric(server, "disagg_ttft_seconds_count") == count + 1)
    frame = status.render(before, status.scrape(server.endpoints.metrics), 1.0)
    assert "decode_0_0" in frame and "orchestrator" in frame
    ttft = next(line for line in frame.splitlines() if line.strip().startswith("TTFT"))
    assert float(ttft.split()[1]) > 0  # a p50 from this interval's one request
    assert status.main(["--metrics", server.endpoints.metrics, "--interval", "0.2", "--once"]) == 0
    assert "decode instance" in capsys.readouterr().out
