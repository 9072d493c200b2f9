"""A partition and a slow link between a decode server and a prefill server (#27 item 4), on
real tritonserver processes and a real network link of the test's own (tests/helpers/netns.py:
a network namespace, a veth pair, 10.77.x.x/30 addresses only).

The prefill server binds the link's root-side address; the KV references it hands out name
the namespace's end, where a relay process forwards to it, so every KV pull decode makes
crosses the veth pair twice while the frontend reaches both servers directly. Taking the
namespace's end down makes KV packets vanish (a connect times out, as across a failed
switch); `tc tbf` limits the link's rate. Each test counts what every request got."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from helpers import netns
from helpers.kv_cluster import PROMPTS, assert_greedy, generate, kv_cluster, run_all
from helpers.netns import NetnsLink

from disagg import contracts as C
from disagg.engine.sequence import SamplingParams
from disagg.serve.server import free_ports

pytestmark = pytest.mark.integration
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
    kv_port, relay_port = free_ports(2)
    relay = link.popen(
        [sys.executable, str(RELAY), link.ns_addr, str(relay_port), link.root_addr, str(kv_port)]
    )
    try:
        assert relay.stdout is not None and relay.stdout.readline().strip() == "relaying"
        with kv_cluster(
            engine_dir, tmp_path_factory.mktemp("kv_partition"),
            "kv-partition-test-token-0123456789", host=link.root_addr, kv_port=kv_port,
            advertise_host=link.ns_addr, kv_advertise_port=relay_port,
        ) as servers:  # fmt: skip
            yield servers
    finally:
        relay.kill()
        relay.wait(timeout=10)


@pytest.fixture(scope="module")
def refs(llm):
    return [llm.generate([p], SamplingParams(max_tokens=24))[0].text for p in PROMPTS]


def test_a_partition_costs_no_request_and_heals_without_a_restart(cluster, link, refs):
    """With the link cut, every request completes with its greedy reply, decode having
    prefilled it, within seconds (before: each KV pull waited out a 30 s timeout, one after
    another in decode's request path: all three hung past 90 s); healed, hand-offs cross the
    link again, with the same server processes."""
    servers = cluster
    r = generate(servers, PROMPTS[0])
    assert r.extra[C.SERVED_BY] == "disaggregated" and r.text == refs[0]  # across the link
    pids = {name: s.proc.pid for name, s in servers.items() if name != "front_settings"}
    with link.partitioned():
        counts, got, took = run_all(servers)
    assert counts == {"completed": 3, "error": 0, "hung": 0}, got
    assert_greedy(got, refs, "fallback")
    assert max(took.values()) < 20, took  # one connect timeout (3 s) and decode's prefill
    deadline = time.monotonic() + 30  # an address that failed is skipped for 5 s
    while (r := generate(servers, PROMPTS[1])).extra[C.SERVED_BY] != "disaggregated":
        assert time.monotonic() < deadline, "hand-offs never crossed the healed link"
        time.sleep(1)
    assert r.text == refs[1]
    assert {name: servers[name].proc.pid for name in pids} == pids  # nothing restarted


def test_a_slow_link_still_hands_off_intact(cluster, link, refs):
    """At 20 Mbit/s a hand-off's KV (~1-2 MB here) takes about a second on the wire: every
    request completes with its greedy reply, its K/V having come across the link."""
    with link.slowed("20mbit"):
        counts, got, _ = run_all(cluster)
    assert counts == {"completed": 3, "error": 0, "hung": 0}, got
    assert_greedy(got, refs, "disaggregated")
