"""Cache-aware replica choice across servers: real tritonserver processes for 2 prefill and 2
decode servers, each publishing its prefix cache's KV events (kvevents.py), and two
frontends that follow them, each on its own (no coordinator). A conversation's next turn
lands on the replicas that served its last one, through either frontend, and finds its
earlier turns cached there; when those replicas are killed, the turn completes on the
others and the frontends know at once."""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers.triton_server import (
    eventually,
    metric,
    ready_or_once_more,
    server_settings,
    servers_under_token,
)

from disagg import contracts as C
from disagg.client import HttpClient
from disagg.serve.server import TritonServer, free_ports
from disagg.serve.supervisor import stub_processes

pytestmark = pytest.mark.integration
HUNG_S = 90
POOLS = ("prefill0", "prefill1", "decode0", "decode1")


@pytest.fixture(scope="module")
def cluster(engine_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache_route")
    with servers_under_token("cache-route-test-token-0123456789") as servers:
        for name in POOLS:
            (events_port,) = free_ports(1)
            s = server_settings(engine_dir, tmp / name, role=name[:-1], kv_events_port=events_port)
            servers[name] = TritonServer(s, admin_key="k").start()
        for name in POOLS:
            ready_or_once_more(servers[name])
        replicas = {
            role: ",".join(servers[f"{role}{i}"].endpoints.grpc for i in range(2))
            for role in ("prefill", "decode")
        }
        for front in ("front0", "front1"):
            s = server_settings(
                engine_dir, tmp / front, role="frontend",
                prefill_replicas=replicas["prefill"], decode_replicas=replicas["decode"],
            )  # fmt: skip
            servers[front] = TritonServer(s, admin_key="k").start()
        for front in ("front0", "front1"):
            ready_or_once_more(servers[front])
        yield servers


def ask(cluster, front: str, prompt_ids: list[int], max_tokens: int = 8):
    body = {C.INPUT_IDS: prompt_ids, C.MAX_TOKENS: max_tokens, C.IGNORE_EOS: True}
    return HttpClient(cluster[front].endpoints.http, timeout_s=HUNG_S).generate(
        "orchestrator", body
    )


def served_on(cluster, r) -> tuple[str, str]:
    """(prefill server, decode server) that served a reply, by their stub pids."""
    where = {}
    for name in POOLS:
        server = cluster[name]
        if server.proc is not None and server.proc.poll() is None:
            for pid in stub_processes(server.proc.pid):
                where[pid] = name
    return where.get(r.extra[C.PREFILL_PID], "?"), where.get(r.extra[C.DECODE_PID], "?")


def following(cluster, front: str) -> None:
    """Wait until `front` follows every replica's KV events (refreshed every 2 s)."""

    def check():
        assert metric(cluster[front], "disagg_replica_kv_events_up") == 4

    eventually(check, timeout_s=20)


def conversation(n: int) -> list[int]:
    """A long shared opening (a system prompt and earlier turns): 200 tokens."""
    return [10 + (7 * i + n) % 900 for i in range(200)]


def test_a_conversation_stays_on_its_replicas_through_either_frontend(cluster):
    following(cluster, "front0")
    following(cluster, "front1")
    first = conversation(1)
    r1 = ask(cluster, "front0", first)
    home = served_on(cluster, r1)
    assert r1.extra[C.SERVED_BY] == "disaggregated" and "?" not in home
    # other conversations in between: the idle replicas take them, or any, by turn
    for n in (2, 3):
        ask(cluster, "front0", conversation(n))
    skipped = metric(cluster["front1"], "disagg_kv_handoff_skipped_bytes_total")
    # the next turn, through the other frontend: its own view, from the replicas' events
    second = first + list(range(50, 70))  # (a reply and a question, in tokens)
    r2 = ask(cluster, "front1", second)
    assert served_on(cluster, r2) == home
    assert r2.extra[C.NUM_CACHED_TOKENS] >= 192  # prefill held the first turn's prompt
    # decode held the first turn: the hand-off left those blocks out
    assert metric(cluster["front1"], "disagg_kv_handoff_skipped_bytes_total") > skipped
    third = second + list(range(70, 90))
    r3 = ask(cluster, "front0", third)
    assert served_on(cluster, r3) == home and r3.extra[C.NUM_CACHED_TOKENS] >= 208
    cluster["home"] = home
    cluster["next"] = third + list(range(90, 110))


def _kill(server: TritonServer) -> None:
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)


def test_when_its_replicas_are_killed_the_next_turn_completes_on_the_others(cluster):
    if "home" not in cluster:
        pytest.skip("needs the conversation of the test before")
    home_prefill, home_decode = cluster["home"]
    pids_before = {name: set(stub_processes(cluster[name].proc.pid)) for name in POOLS}
    _kill(cluster[home_prefill])
    _kill(cluster[home_decode])
    killed = time.monotonic()
    # at once: the frontend may not have heard yet; the turn must complete all the same
    r = ask(cluster, "front0", cluster["next"], max_tokens=8)
    assert r.num_output_tokens == 8 and r.finish_reason == "length"
    others = {n for n in POOLS if n not in (home_prefill, home_decode)}
    prefill_pid, decode_pid = r.extra[C.PREFILL_PID], r.extra[C.DECODE_PID]
    assert any(decode_pid in pids_before[n] for n in others)
    if r.extra[C.SERVED_BY] == "disaggregated":
        assert any(prefill_pid in pids_before[n] for n in others)

    def known():  # the event streams broke: both frontends took the killed ones out
        for front in ("front0", "front1"):
            for name in (home_prefill, home_decode):
                grpc = cluster[name].endpoints.grpc
                assert metric(cluster[front], "disagg_replica_up", replica=grpc) == 0

    eventually(known, timeout_s=3.0)  # (the gauges refresh every 2 s)
    assert time.monotonic() - killed < 30
    # and the other frontend sends the conversation to the survivors too
    r = ask(cluster, "front1", cluster["next"])
    assert r.num_output_tokens == 8 and r.extra[C.SERVED_BY] == "disaggregated"
    survivors = (
        next(n for n in others if n.startswith("prefill")),
        next(n for n in others if n.startswith("decode")),
    )
    assert served_on(cluster, r) == survivors
