"""Cluster faults that are not a pool server's kill -9 (#27 item 4), on real tritonserver
processes: a prefill server whose KV port is reached through a tampering proxy (its
advertised port, kv_advertise_port, is the proxy's), a decode server and a frontend.
- KV bytes damaged on the way: a payload that fails its CRC is the hand-off's failure, not
  the client's; decode prefills the prompt itself and the request completes.
- The frontend killed while streams are open: each client gets a clear error, decode frees
  the orphaned sequences, and a restarted frontend serves.
Each test counts what every request got."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from helpers.kv_cluster import HUNG_S, PROMPTS, assert_greedy, generate, kv_cluster, run_all
from helpers.tamper_proxy import TamperProxy
from helpers.triton_server import metric, ready_or_once_more

from disagg import contracts as C
from disagg.client import GenerateError, HttpClient
from disagg.engine.sequence import SamplingParams
from disagg.serve.server import TritonServer, free_ports

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(engine_dir, tmp_path_factory):
    (kv_port,) = free_ports(1)
    proxy = TamperProxy(kv_port)
    tmp = tmp_path_factory.mktemp("kv_faults")
    try:
        with kv_cluster(
            engine_dir, tmp, "kv-faults-test-token-0123456789", kv_port=kv_port,
            kv_advertise_port=proxy.port,
        ) as servers:  # fmt: skip
            yield servers, proxy
    finally:
        proxy.close()


def test_kv_pulled_through_the_proxy_is_handed_off_intact(cluster, llm):
    servers, proxy = cluster
    (ref,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24))
    r = generate(servers, PROMPTS[0])
    assert r.extra[C.SERVED_BY] == "disaggregated" and r.text == ref.text
    assert proxy.relayed >= 1  # decode pulled it at the advertised port


def test_damaged_kv_bytes_cost_no_request(cluster, llm):
    """Every request completes with its greedy reply, decode having prefilled it (before,
    the CRC failure was the client's 400)."""
    servers, proxy = cluster
    refs = [llm.generate([p], SamplingParams(max_tokens=24))[0].text for p in PROMPTS]
    proxy.corrupt.set()
    try:
        counts, got, _ = run_all(servers)
    finally:
        proxy.corrupt.clear()
    assert counts == {"completed": 3, "error": 0, "hung": 0}, got
    assert proxy.damaged >= 3  # every hand-off arrived damaged
    assert_greedy(got, refs, "fallback")
    errors = metric(servers["frontend"], "disagg_errors_total", stage="kv_handoff")
    assert errors >= 3


def test_a_frontend_killed_with_streams_open_leaves_nothing_running(cluster):
    """Every open stream ends with a clear error (none hangs), the decode server drops the
    sequences nobody will read within a few seconds (its gRPC streams are cancelled by the
    broken connections), and a frontend started again serves at once."""
    servers, _ = cluster
    got: dict[str, object] = {}
    started = threading.Event()

    def run(i: int) -> None:
        client = HttpClient(servers["frontend"].endpoints.http, timeout_s=HUNG_S)
        body = {C.INPUT_IDS: [7 + i] * 64, C.MAX_TOKENS: 400, C.IGNORE_EOS: True}
        try:
            got[f"r{i}"] = client.generate(
                "orchestrator", body, stream=True, on_delta=lambda d: started.set()
            )
        except (GenerateError, OSError) as e:  # the server went away: a clear error
            got[f"r{i}"] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert started.wait(HUNG_S)  # (the first token comes from prefill: decode may not be on)
    decode = servers["decode"]
    deadline = time.monotonic() + 30
    while metric(decode, "disagg_decode_active_sequences") < 3:
        assert time.monotonic() < deadline, "the streams never reached decode"
        time.sleep(0.1)
    os.killpg(servers["frontend"].proc.pid, signal.SIGKILL)
    servers["frontend"].proc.wait(timeout=30)
    for t in threads:
        t.join(HUNG_S)
    counts = {"completed": 0, "error": 0, "hung": 0}
    for i in range(3):
        r = got.get(f"r{i}")
        counts["hung" if r is None else "error" if isinstance(r, Exception) else "completed"] += 1
    assert counts["hung"] == 0 and counts["error"] >= 1, got  # (a stream may have finished)
    deadline = time.monotonic() + 15
    while metric(decode, "disagg_decode_active_sequences") > 0:
        assert time.monotonic() < deadline, "decode kept decoding for a dead frontend"
        time.sleep(0.25)
    servers["frontend"] = TritonServer(servers["front_settings"], admin_key="k").start()
    ready_or_once_more(servers["frontend"])
    r = generate(servers, PROMPTS[0])
    assert r.num_output_tokens > 0 and r.extra[C.SERVED_BY] == "disaggregated"
