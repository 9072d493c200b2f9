"""A partition and a slow link between a decode server and a prefill server (#27 item 4), on
real tritonserver processes and a real network link of the test's own (tests/helpers/netns.py:
a network namespace, a veth pair, 10.77.x.x/30 addresses only).

The prefill server binds the link's root-side address; the KV references it hands out name
the namespace's end, where a relay process forwards to it, so every KV pull decode makes
crosses the veth pair twice while the frontend reaches both servers directly. Taking the
namespace's end down makes KV packets vanish (a connect times out, as across a failed
switch); `tc tbf` limits the link's rate. Each test counts what every request got."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import netns
from helpers.netns import NetnsLink
from helpers.triton_server import server_settings

from disagg import contracts as C
from disagg.client import GenerateError, HttpClient
from disagg.contracts import TOKEN_ENV
from disagg.engine.sequence import SamplingParams
from disagg.serve.server import TritonServer, free_ports

pytestmark = pytest.mark.integration
PROMPTS = ["What is the capital of France?", "List three prime numbers.", "Say hello in French."]
HUNG_S = 90
RELAY = Path(__file__).resolve().parents[1] / "helpers" / "tamper_proxy.py"


@pytest.fixture(scope="module")
def link():
    why = netns.available()
    if why:
        pytest.skip(why)  # CI runs as root with iproute2 (.ci/run installs it)
    made = NetnsLink()
    yield made
    made.cleanup()


@pytest.fixture(scope="module")
def cluster(engine_dir, tmp_path_factory, link):
    saved = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = "kv-partition-test-token-0123456789"
    tmp = tmp_path_factory.mktemp("kv_partition")
    kv_port, relay_port = free_ports(2)
    relay = link.popen(
        [sys.executable, str(RELAY), link.ns_addr, str(relay_port), link.root_addr, str(kv_port)]
    )
    assert relay.stdout is not None and relay.stdout.readline().strip() == "relaying"
    servers: dict[str, TritonServer] = {}
    try:
        prefill = server_settings(
            engine_dir, tmp / "prefill", role="prefill", host=link.root_addr, kv_port=kv_port,
            advertise_host=link.ns_addr, kv_advertise_port=relay_port,
        )  # fmt: skip
        servers["prefill"] = TritonServer(prefill, admin_key="k").start()
        servers["decode"] = TritonServer(
            server_settings(engine_dir, tmp / "decode", role="decode"), admin_key="k"
        ).start()
        for server in servers.values():
            server.wait_ready(timeout_s=240)
        front = server_settings(
            engine_dir, tmp / "frontend", role="frontend",
            prefill_replicas=servers["prefill"].endpoints.grpc,
            decode_replicas=servers["decode"].endpoints.grpc,
        )  # fmt: skip
        servers["frontend"] = TritonServer(front, admin_key="k").start()
        servers["frontend"].wait_ready(timeout_s=240)
        yield servers
    finally:
        for server in servers.values():
            server.stop()
        relay.kill()
        relay.wait(timeout=10)
        if saved is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = saved


def generate(servers, prompt: str):
    client = HttpClient(servers["frontend"].endpoints.http, timeout_s=HUNG_S)
    body = {C.TEXT_INPUT: prompt, C.APPLY_CHAT_TEMPLATE: True, C.MAX_TOKENS: 24,
            C.EXCLUDE_INPUT_IN_OUTPUT: True}  # fmt: skip
    return client.generate("router", body)


def run_all(servers) -> tuple[dict[str, int], dict[str, object], dict[str, float]]:
    """The three prompts at once: (counts, what each got, seconds each took)."""
    got: dict[str, object] = {}
    took: dict[str, float] = {}

    def run(i: int) -> None:
        t = time.monotonic()
        try:
            got[f"r{i}"] = generate(servers, PROMPTS[i])
        except GenerateError as e:
            got[f"r{i}"] = e
        took[f"r{i}"] = time.monotonic() - t

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HUNG_S)
    counts = {"completed": 0, "error": 0, "hung": 0}
    for i in range(3):
        r = got.get(f"r{i}")
        counts["hung" if r is None else "error" if isinstance(r, Exception) else "completed"] += 1
    return counts, got, took


def test_a_partition_costs_no_request_and_heals_without_a_restart(cluster, link, llm):
    """With the link cut, every request completes with its greedy reply, decode having
    prefilled it, within seconds (before: each KV pull waited out a 30 s timeout, one after
    another in decode's request path); healed, hand-offs cross the link again, with the same
    server processes."""
    servers = cluster
    refs = [llm.generate([p], SamplingParams(max_tokens=24))[0].text for p in PROMPTS]
    r = generate(servers, PROMPTS[0])
    assert r.extra[C.SERVED_BY] == "disaggregated" and r.text == refs[0]  # across the link
    pids = {name: s.proc.pid for name, s in servers.items()}
    link.partition()
    try:
        counts, got, took = run_all(servers)
    finally:
        link.heal()
    assert counts == {"completed": 3, "error": 0, "hung": 0}, got
    for i in range(3):
        assert got[f"r{i}"].text == refs[i] and got[f"r{i}"].extra[C.SERVED_BY] == "fallback"
    assert max(took.values()) < 20, took  # one connect timeout (3 s) and decode's prefill
    deadline = time.monotonic() + 30  # an address that failed is skipped for 5 s
    while (r := generate(servers, PROMPTS[1])).extra[C.SERVED_BY] != "disaggregated":
        assert time.monotonic() < deadline, "hand-offs never crossed the healed link"
        time.sleep(1)
    assert r.text == refs[1]
    assert {name: s.proc.pid for name, s in servers.items()} == pids  # nothing restarted


def test_a_slow_link_still_hands_off_intact(cluster, link, llm):
    """At 20 Mbit/s a hand-off's KV (~1-2 MB here) takes about a second on the wire: every
    request completes with its greedy reply and its K/V came across the link."""
    servers = cluster
    refs = [llm.generate([p], SamplingParams(max_tokens=24))[0].text for p in PROMPTS]
    link.slow("20mbit")
    try:
        counts, got, took = run_all(servers)
    finally:
        link.fast()
    assert counts == {"completed": 3, "error": 0, "hung": 0}, got
    for i in range(3):
        assert got[f"r{i}"].text == refs[i]
        assert got[f"r{i}"].extra[C.SERVED_BY] == "disaggregated", took
