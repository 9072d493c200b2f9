"""A client that leaves during a long prefill, on a real tritonserver (issue 27, item 3): the
prefill stops at its next layer, so the next request's first token comes well before the
whole prefill would have ended, and no KV bytes stay held for a decode that never comes.
Once over BLS (router -> orchestrator -> prefill in one server: the cancel travels as a
mark, cancel.py) and once over the cross-server path (the orchestrator's pools are this
server's own models over gRPC: the cancel travels as the gRPC call's cancellation, the
payload as a kvnet lease). Timing margins are against a whole prefill measured in the same
test, so a noisy 2-core box does not flake them."""

from __future__ import annotations

import dataclasses
import time

import pytest
import tritonclient.grpc as grpcclient
from helpers.triton_server import eventually, metric, server_settings, start_with

from disagg import contracts as C
from disagg.client import grpc_inputs
from disagg.contracts import TOKEN_ENV

pytestmark = pytest.mark.integration
PROMPT_TOKENS = 1800  # (max_model_len 2048 here)


def long_prompt(tokenizer, tag: str) -> str:
    """About PROMPT_TOKENS tokens, different from the first token on for each tag (no
    prefix cache hit between two of them)."""
    body = " ".join(f"{tag} note {i}: the tide, the boats and the weather." for i in range(300))
    ids = tokenizer.encode(f"{tag}. {body}")[:PROMPT_TOKENS]
    return tokenizer.decode(ids)


def request(text: str) -> list[grpcclient.InferInput]:
    return grpc_inputs({C.TEXT_INPUT: text, C.MAX_TOKENS: 1, C.STREAM: True})


def first_token_s(url: str, text: str) -> float:
    """Seconds from sending to the first response of a streamed router request."""
    client = grpcclient.InferenceServerClient(url)
    got = []
    client.start_stream(callback=lambda result, error: got.append((result, error)))
    start = time.monotonic()
    client.async_stream_infer("router", request(text), enable_empty_final_response=True)
    while not got:
        assert time.monotonic() - start < 120, "no first response"
        time.sleep(0.005)
    took = time.monotonic() - start
    client.stop_stream()
    client.close()
    assert got[0][1] is None, got[0][1]
    return took


def leave_after(url: str, text: str, after_s: float, before_any: bool = True) -> None:
    """Send a streamed request and go away after `after_s` (`before_any`: before any
    response, else nothing would be tested)."""
    client = grpcclient.InferenceServerClient(url)
    got = []
    client.start_stream(callback=lambda result, error: got.append((result, error)))
    client.async_stream_infer("router", request(text), enable_empty_final_response=True)
    time.sleep(after_s)
    assert not before_any or got == [], "the prefill ended before the client left"
    client.stop_stream(cancel_requests=True)
    client.close()


@pytest.fixture
def local(engine_dir, tmp_path):
    server = start_with(server_settings(engine_dir, tmp_path))
    yield server
    server.stop()


@pytest.fixture
def looped(engine_dir, tmp_path, monkeypatch):
    """One server whose orchestrator reaches its prefill and decode over gRPC, as a frontend
    reaches them on other servers (prefill leases its payloads, decode pulls them)."""
    monkeypatch.setenv(TOKEN_ENV, "cancel-test-token-0123456789")
    s = server_settings(engine_dir, tmp_path, kv_lease_s=120.0)
    own = f"127.0.0.1:{s.grpc_port}"
    server = start_with(dataclasses.replace(s, prefill_replicas=own, decode_replicas=own))
    yield server
    server.stop()


def check_a_client_leaving_mid_prefill_frees_the_prefill_worker(server, tokenizer) -> float:
    url = server.endpoints.grpc
    first_token_s(url, "Warm up.")
    whole_s = first_token_s(url, long_prompt(tokenizer, "Alpha"))  # a whole prefill
    cancelled = metric(server, "disagg_prefill_cancelled_total")
    leave_after(url, long_prompt(tokenizer, "Bravo"), 0.3)
    left = time.monotonic()
    next_s = first_token_s(url, "Hi")  # one prefill worker: it waits for Bravo's to stop
    waited = time.monotonic() - left
    # today it waits for the rest of Bravo's prefill (whole_s - 0.3); now for one layer
    assert waited < whole_s * 0.5, (waited, whole_s)
    eventually(
        lambda: assert_equal(metric(server, "disagg_prefill_cancelled_total"), cancelled + 1)
    )
    assert metric(server, "disagg_decode_active_sequences") == 0.0  # decode never got it
    return next_s


def assert_equal(a: float, b: float) -> None:
    assert a == b, (a, b)


def test_a_client_gone_mid_prefill_stops_it_over_bls(local, tokenizer):
    check_a_client_leaving_mid_prefill_frees_the_prefill_worker(local, tokenizer)


def test_a_client_gone_mid_prefill_stops_it_across_servers_and_holds_no_kv(looped, tokenizer):
    check_a_client_leaving_mid_prefill_frees_the_prefill_worker(looped, tokenizer)
    url = looped.endpoints.grpc
    assert metric(looped, "disagg_kv_leased_bytes") == 0.0
    # a client that leaves as its prefill ends: stopped in its last layers, or finished and
    # its lease dropped by the orchestrator; either way no bytes wait for the 120 s TTL
    # (several points near the end: the prefill server packs and leases the payload after
    # its last layer, and a caller gone by then never receives the lease's reference)
    whole_s = first_token_s(url, long_prompt(tokenizer, "Charlie"))
    for i, fraction in enumerate((0.85, 0.95, 1.02)):
        leave_after(url, long_prompt(tokenizer, f"Delta{i}"), whole_s * fraction, False)
        time.sleep(2.0)  # (past the rest of that prefill: a lease it made would show by now)
        eventually(lambda: assert_equal(metric(looped, "disagg_kv_leased_bytes"), 0.0), 8.0)
    assert metric(looped, "disagg_kv_handoff_bytes_count", path="network") >= 2  # (the path)
