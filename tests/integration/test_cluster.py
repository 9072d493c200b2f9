"""Pools on separate servers: real tritonserver processes, each with its own ports and process
group, stand for the nodes (a frontend, 2 prefill and 2 decode servers). KV payloads go from
a prefill server to a decode server over TCP (kvnet), never through the frontend. Each fault
test counts what every affected request got: completed, a clear error, or nothing (hung)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from helpers.triton_server import ready_or_once_more, server_settings, servers_under_token

from disagg import contracts as C
from disagg.client import GenerateError, HttpClient
from disagg.engine.sequence import SamplingParams
from disagg.serve.server import TritonServer
from disagg.serve.supervisor import stub_processes

pytestmark = pytest.mark.integration
PROMPTS = ["What is the capital of France?", "List three prime numbers.", "Say hello in French."]
HUNG_S = 90
HANG_S = 4.0  # the frontend's decode_hang_s: a frozen decode node's streams move on after it


@pytest.fixture(scope="module")
def cluster(engine_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    with servers_under_token("cluster-test-token-0123456789") as servers:
        for role in ("prefill", "decode"):
            for i in range(2):
                s = server_settings(engine_dir, tmp / f"{role}{i}", role=role)
                servers[f"{role}{i}"] = TritonServer(s, admin_key="k").start()
        for server in servers.values():
            ready_or_once_more(server)
        replicas = {
            role: ",".join(servers[f"{role}{i}"].endpoints.grpc for i in range(2))
            for role in ("prefill", "decode")
        }
        # the prefill pool from a file the frontend re-reads: a later test adds a server
        (tmp / "prefill.txt").write_text(replicas["prefill"].replace(",", "\n") + "\n")
        replicas["prefill"] = f"file:{tmp / 'prefill.txt'}"
        front = server_settings(
            engine_dir,
            tmp / "frontend",
            role="frontend",
            prefill_replicas=replicas["prefill"],
            decode_replicas=replicas["decode"],
            decode_hang_s=HANG_S,
        )
        servers["frontend"] = TritonServer(front, admin_key="k").start()
        ready_or_once_more(servers["frontend"])
        servers["tmp"] = tmp
        yield servers


def http(cluster) -> HttpClient:
    return HttpClient(cluster["frontend"].endpoints.http, timeout_s=HUNG_S)


def chat(prompt: str, max_tokens: int = 32) -> dict:
    return {
        C.TEXT_INPUT: prompt,
        C.APPLY_CHAT_TEMPLATE: True,
        C.MAX_TOKENS: max_tokens,
        C.EXCLUDE_INPUT_IN_OUTPUT: True,
    }


def stubs_of(server: TritonServer, model: str) -> set[int]:
    return {pid for pid, (m, _) in stub_processes(server.proc.pid).items() if m == model}


def test_each_server_runs_only_its_role(cluster):
    assert stubs_of(cluster["prefill0"], "prefill") and not stubs_of(cluster["prefill0"], "decode")
    assert stubs_of(cluster["decode0"], "decode") and not stubs_of(cluster["decode0"], "router")
    front = cluster["frontend"]
    assert stubs_of(front, "router") and stubs_of(front, "orchestrator")
    assert not stubs_of(front, "prefill") and not stubs_of(front, "decode")


def test_greedy_replies_equal_the_single_process_engine(cluster, llm):
    for prompt in PROMPTS[:2]:
        (ref,) = llm.generate([prompt], SamplingParams(max_tokens=32))
        r = http(cluster).generate("router", chat(prompt))
        assert r.text == ref.text and r.num_output_tokens == len(ref.token_ids)
        assert r.extra[C.SERVED_BY] == "disaggregated"


def test_kv_bytes_go_from_prefill_to_decode_not_through_the_frontend(cluster):
    r = http(cluster).generate("orchestrator", {C.INPUT_IDS: list(range(1, 300)), C.MAX_TOKENS: 4})
    # the frontend forwarded only a reference: the payload itself is ~13.8 MB for 299 tokens
    assert 0 < r.extra[C.KV_BYTES] < 1024
    prefill_pids = set().union(*(stubs_of(cluster[f"prefill{i}"], "prefill") for i in (0, 1)))
    decode_pids = set().union(*(stubs_of(cluster[f"decode{i}"], "decode") for i in (0, 1)))
    assert r.extra[C.PREFILL_PID] in prefill_pids and r.extra[C.DECODE_PID] in decode_pids
    assert r.num_output_tokens == 4


def test_load_spreads_over_the_replicas(cluster):
    results, threads = [], []
    for i in range(6):
        body = {C.INPUT_IDS: [1 + i, 2, 3, 4], C.MAX_TOKENS: 24, C.IGNORE_EOS: True}
        t = threading.Thread(
            target=lambda b=body: results.append(http(cluster).generate("orchestrator", b))
        )
        threads.append(t)
        t.start()
    for t in threads:
        t.join(HUNG_S)
    assert len(results) == 6
    assert len({r.extra[C.DECODE_PID] for r in results}) == 2  # both decode servers
    assert len({r.extra[C.PREFILL_PID] for r in results}) == 2


def test_replicas_and_the_network_path_show_in_metrics_and_status(cluster):
    from helpers.triton_server import eventually, metric

    from disagg import status

    front = cluster["frontend"]

    def counted():
        assert metric(front, "disagg_replica_requests_total", pool="decode") >= 6
        assert metric(front, "disagg_replica_up", pool="prefill") == 2
        assert metric(front, "disagg_kv_handoff_bytes_count", path="network") >= 6
        assert metric(front, "disagg_kv_handoff_bytes_count", path="shm") == 0

    eventually(counted, timeout_s=10)  # refreshed every 2 s
    # the bytes counted are the payloads decode pulled (MBs), not the references (< 1 KB)
    moved = metric(front, "disagg_kv_handoff_bytes_sum", path="network")
    assert moved / metric(front, "disagg_kv_handoff_bytes_count", path="network") > 100_000
    now = status.scrape(front.endpoints.metrics)
    frame = status.render(now, now, 1.0)
    assert "replicas" in frame and cluster["decode1"].endpoints.grpc in frame
    assert "network" in frame


def _serving_decode_server(cluster) -> str:
    """The decode server with a sequence in its engine now."""
    from helpers.triton_server import metric

    for name in ("decode0", "decode1"):
        server = cluster[name]
        if server.proc.poll() is None and metric(server, "disagg_decode_active_sequences") > 0:
            return name
    raise AssertionError("no decode server is decoding")


def _stream_with_decode_fault(cluster, llm, prompt: str, sig: int):
    """A greedy 96-token stream whose decode server gets `sig` after 12 deltas: (the reply,
    its deltas, the gaps between them, the faulted server's name). The stream must be one
    stream: no text repeated or missing, the greedy reply of an undisturbed run."""
    n = 96
    (ref,) = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    deltas, faulted, gaps = [], [], []
    last = [time.monotonic()]

    def on_delta(d):
        now = time.monotonic()
        gaps.append(now - last[0])
        last[0] = now
        deltas.append(d)
        if len(deltas) == 12 and not faulted:
            faulted.append(_serving_decode_server(cluster))
            os.killpg(cluster[faulted[0]].proc.pid, sig)

    body = {**chat(prompt, n), C.IGNORE_EOS: True}
    try:
        r = http(cluster).generate("router", body, stream=True, on_delta=on_delta)
    finally:
        if faulted and sig == signal.SIGSTOP:
            os.killpg(cluster[faulted[0]].proc.pid, signal.SIGCONT)
    assert faulted, "the stream ended before the fault"
    assert r.num_output_tokens == n and r.finish_reason == "length"
    assert "".join(deltas) == r.text == ref.text
    return gaps, faulted[0]


def test_a_decode_server_frozen_mid_stream_moves_the_stream_to_the_other(cluster, llm):
    """SIGSTOP, not SIGKILL (#27 item 4): a hung node never sends an error, and its TCP
    connections stay open. The stream, silent for decode_hang_s after its tokens began, moves
    to the other decode server; thawed, the frozen server serves again."""
    gaps, frozen = _stream_with_decode_fault(
        cluster, llm, "Write a long story about a castle.", signal.SIGSTOP
    )
    assert HANG_S <= max(gaps) < HANG_S + 30  # it waited out decode_hang_s, then moved on
    cluster[frozen].wait_ready(timeout_s=120)  # thawed, it answers again
    again = http(cluster).generate("orchestrator", {C.INPUT_IDS: [1, 2, 3], C.MAX_TOKENS: 4})
    assert again.num_output_tokens == 4


def test_a_decode_server_killed_mid_stream_moves_the_stream_to_the_other(cluster, llm):
    _, killed = _stream_with_decode_fault(
        cluster, llm, "Write a long story about a dragon.", signal.SIGKILL
    )
    cluster[killed].proc.wait(timeout=30)
    # the survivor serves what comes next
    again = http(cluster).generate("orchestrator", {C.INPUT_IDS: [1, 2, 3], C.MAX_TOKENS: 4})
    assert again.num_output_tokens == 4


class Outcomes:
    def __init__(self) -> None:
        self.got: dict[str, str] = {}

    def run(self, name: str, call) -> None:
        try:
            r = call()
            self.got[name] = "completed" if r.num_output_tokens > 0 else f"empty {r}"
        except GenerateError as e:
            self.got[name] = f"error: {e}"

    def counts(self, names) -> dict:
        c = {"completed": 0, "error": 0, "hung": 0}
        for n in names:
            v = self.got.get(n)
            c["hung" if v is None else "completed" if v == "completed" else "error"] += 1
        return c


def _kill(server: TritonServer) -> None:
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)


def _under_load(cluster, n: int, fault) -> Outcomes:
    out = Outcomes()
    threads = []
    for i in range(n):
        body = {C.INPUT_IDS: [5 + i] * 200, C.MAX_TOKENS: 48, C.IGNORE_EOS: True}
        t = threading.Thread(
            target=out.run,
            args=(f"r{i}", lambda b=body: http(cluster).generate("orchestrator", b)),
        )
        threads.append(t)
        t.start()
        time.sleep(0.05)
    fault()
    for t in threads:
        t.join(HUNG_S)
    return out


def test_a_prefill_server_killed_under_load_costs_no_request(cluster):
    out = _under_load(cluster, 6, lambda: _kill(cluster["prefill1"]))
    assert out.counts([f"r{i}" for i in range(6)]) == {"completed": 6, "error": 0, "hung": 0}, (
        out.got
    )
    r = http(cluster).generate("orchestrator", {C.INPUT_IDS: [1, 2, 3], C.MAX_TOKENS: 4})
    assert r.extra[C.SERVED_BY] == "disaggregated"  # the other prefill server


def test_with_the_whole_prefill_pool_gone_decode_serves_co_located(cluster, llm):
    _kill(cluster["prefill0"])  # prefill1 died in the test before
    out = _under_load(cluster, 4, lambda: None)
    assert out.counts([f"r{i}" for i in range(4)]) == {"completed": 4, "error": 0, "hung": 0}, (
        out.got
    )
    (ref,) = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=32))
    r = http(cluster).generate("router", chat(PROMPTS[2]))
    assert r.extra[C.SERVED_BY] == "fallback" and r.text == ref.text


def test_a_new_prefill_server_takes_traffic_within_10_s_of_being_listed(cluster, engine_dir):
    """After the whole pool died (the test before): a new server, once ready, is added to
    the list the frontend re-reads; requests are disaggregated again within 10 s."""
    tmp = cluster["tmp"]
    new = TritonServer(server_settings(engine_dir, tmp / "prefill2", role="prefill"), "k")
    cluster["prefill2"] = new.start()
    new.wait_ready(timeout_s=240)
    (tmp / "prefill.txt").write_text(new.endpoints.grpc + "\n")
    listed = time.monotonic()
    new_pids = stubs_of(new, "prefill")
    while True:
        r = http(cluster).generate("orchestrator", {C.INPUT_IDS: [1, 2, 3], C.MAX_TOKENS: 2})
        if r.extra[C.SERVED_BY] == "disaggregated" and r.extra[C.PREFILL_PID] in new_pids:
            break
        assert time.monotonic() - listed < 10, "the new replica took no traffic in 10 s"
        time.sleep(0.5)
