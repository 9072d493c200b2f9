"""The OpenAI-compatible gateway in front of a real tritonserver, used through the official
`openai` package (and raw HTTP where a well-behaved client cannot send what is tested)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import replace

import openai
import pytest
from helpers.triton_server import eventually, metric, metric_becomes, scrape, start_server

from disagg.serve.gateway_process import GatewayProcess
from disagg.serve.server import free_ports

pytestmark = pytest.mark.integration
KEYS = "sk-test-alpha,sk-test-beta"
ADMIN = "test-admin-key"
MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]

REGISTRY = """
[models."smollm2-135m-instruct"]
versions = [
  { name = "v1", triton_model = "router", state = "stable" },
  { name = "v2", triton_model = "router", triton_version = "1", state = "canary", weight = 0.0 },
  { name = "v0", triton_model = "router", state = "deprecated" },
]

[models."smollm2-old"]
deprecated = "smollm2-135m-instruct"
"""


@pytest.fixture(scope="module")
def stack(engine_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    (tmp / "models.toml").write_text(REGISTRY)
    server = start_server(engine_dir, tmp / "triton", gateway_models=str(tmp / "models.toml"))
    (gw_port,) = free_ports(1)
    settings = replace(server.settings, gateway_port=gw_port)
    env = {"DISAGG_API_KEYS": KEYS, "DISAGG_ADMIN_KEY": ADMIN}
    gateway = GatewayProcess(settings, env=env).start()
    try:
        gateway.wait_ready()
        yield server, gateway, settings
    finally:
        gateway.stop()
        server.stop()


@pytest.fixture(scope="module")
def gateway(stack):
    return stack[1]


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-test-alpha", max_retries=0)


def raw(gateway, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, parsed JSON body) of one raw HTTP call."""
    req = urllib.request.Request(
        gateway.url + path,
        data=body,
        headers={"Authorization": "Bearer sk-test-beta", **(headers or {})},
        method="POST" if body is not None else "GET",
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def admin(gateway, path: str, body: dict | None = None):
    return raw(gateway, path, json.dumps(body or {}).encode(), {"admin-key": ADMIN})


def test_chat_streamed_text_equals_the_non_streamed_text(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert "Paris" in full.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens > 0
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens > 0


HARBOUR = "You are the harbour master's terse assistant; you know tides, berths and pilots. " * 8


def _cached(resp) -> int:
    details = resp.usage.prompt_tokens_details
    return details.cached_tokens if details else 0


def test_a_second_chat_turn_reuses_the_first_turns_kv(client, gateway, stack):
    """The prefix cache through every hop (gateway -> router -> orchestrator -> pools):
    the second turn's usage names the cached prompt tokens, its reply is the one the same
    turn gets with the cache bypassed, and another API key gets no hit from this key's."""
    ask = {"model": MODEL, "max_tokens": 12, "temperature": 0.0}
    turn1 = [{"role": "system", "content": HARBOUR}, {"role": "user", "content": "A boat?"}]
    r1 = client.chat.completions.create(messages=turn1, **ask)
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And another one?"},
    ]
    r2 = client.chat.completions.create(messages=turn2, **ask)
    assert _cached(r2) >= 96 and _cached(r2) < r2.usage.prompt_tokens  # whole 16-token blocks
    bypass = client.chat.completions.create(
        messages=turn2, extra_body={"use_prefix_cache": False}, **ask
    )
    assert _cached(bypass) == 0
    assert bypass.choices[0].message.content == r2.choices[0].message.content
    # streamed, the usage chunk says the same
    stream = client.chat.completions.create(
        messages=turn2, stream=True, stream_options={"include_usage": True}, **ask
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r2.choices[0].message.content and _cached(chunks[-1]) >= _cached(r2)
    # another key: its own namespace, no hit from alpha's turns
    beta = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-test-beta", max_retries=0)
    other = beta.chat.completions.create(messages=turn2, **ask)
    assert _cached(other) == 0
    assert other.choices[0].message.content == r2.choices[0].message.content
    # what the pools and the orchestrator counted (the test server runs disaggregated: the
    # prefill pool prefilled, and hit; decode keeps the handed-off prompts and replies)
    server = stack[0]

    def counted() -> None:
        hits = metric(server, "disagg_prefix_cache_hit_tokens_total", pool="prefill")
        assert hits >= 2 * _cached(r2)  # the turn, and the same turn streamed
        for pool in ("prefill", "decode"):
            assert metric(server, "disagg_prefix_cache_used_tokens", pool=pool) > 0, pool
        assert metric(server, "disagg_request_cached_tokens_sum") >= 2 * _cached(r2)

    eventually(counted, 10)


KV_BYTES_PER_TOKEN = 46080  # SmolLM2-135M: K and V, 30 layers, 3 KV heads of 64, fp32
PAYLOAD_HEADER = 1024  # engine/kv_payload.py HEADER_SPACE


def test_a_second_turns_hand_off_moves_only_what_decode_lacks(client, stack):
    """Decode kept the first turn's prompt and reply; the second turn's hand-off leaves
    those blocks out (decode copies them from its cache), and the reply is the one a whole
    hand-off gives (the same turn with the cache bypassed)."""
    server = stack[0]
    moved, left_out = "disagg_kv_handoff_bytes_sum", "disagg_kv_handoff_skipped_bytes_total"
    ask = {"model": MODEL, "max_tokens": 12, "temperature": 0.0}
    system = "You keep the lighthouse log: lamps, storms, ships passing and the keeper's rota. "
    turn1 = [{"role": "system", "content": system * 8}, {"role": "user", "content": "Tonight?"}]

    def served(messages, **extra):
        """(reply, bytes moved, bytes left out) of one request, from the server's metrics."""
        done = "disagg_request_cached_tokens_count"  # the orchestrator's last update of a request
        before = [metric(server, name) for name in (moved, left_out, done)]
        r = client.chat.completions.create(messages=messages, **ask, **extra)

        def landed() -> None:
            assert metric(server, done) == before[2] + 1

        eventually(landed, 10)
        return r, metric(server, moved) - before[0], metric(server, left_out) - before[1]

    misses = metric(server, "disagg_kv_handoff_prefix_misses_total")
    r1, moved1, skipped1 = served(turn1)
    assert skipped1 == 0 and moved1 == r1.usage.prompt_tokens * KV_BYTES_PER_TOKEN + PAYLOAD_HEADER
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And at dawn?"},
    ]
    r2, moved2, skipped2 = served(turn2)
    whole = r2.usage.prompt_tokens * KV_BYTES_PER_TOKEN
    assert moved2 + skipped2 == whole + PAYLOAD_HEADER  # every position: moved or left out
    assert skipped2 >= 0.7 * whole and skipped2 % (16 * KV_BYTES_PER_TOKEN) == 0
    assert moved2 < moved1 / 3, (moved1, moved2)
    bypass, moved_bypass, _ = served(turn2, extra_body={"use_prefix_cache": False})
    assert moved_bypass == whole + PAYLOAD_HEADER  # the whole prompt's K/V, as before
    assert r2.choices[0].message.content == bypass.choices[0].message.content
    assert metric(server, "disagg_kv_handoff_prefix_misses_total") == misses


def test_a_bad_cache_salt_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"cache_salt": 5}
        )
    with pytest.raises(openai.BadRequestError, match="use_prefix_cache"):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"use_prefix_cache": "no"}
        )


def test_completions_and_length_finish(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    streamed = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_stop_and_max_completion_tokens(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=24, stop=["Paris"]
    )
    assert "Paris" not in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_models_health_and_readiness(client, gateway):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, body = raw(gateway, "/ready")
    assert status == 200 and body["ready"] is True
    assert raw(gateway, "/health")[0] == 200


def test_errors_in_openai_format(gateway, client):
    bad_key = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad_key.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert e.value.body["code"] == "model_not_found"
    for kwargs, param in [
        ({"n": 17}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"1": 500}}, "logit_bias"),  # out of [-100, 100]
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"temperature": 5}, "temperature"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        assert e.value.body["param"] == param, kwargs
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the engine's own limit
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100_000)


def test_deprecated_models_and_versions_name_their_replacement(client):
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="smollm2-old", messages=MESSAGES)
    assert e.value.status_code == 410 and "use 'smollm2-135m-instruct'" in e.value.message
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=f"{MODEL}:v0", messages=MESSAGES)
    assert e.value.status_code == 410 and f"'{MODEL}:v1'" in e.value.message


def _chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}).encode()


SURROGATE = b'"\\ud800"'  # JSON text for a lone surrogate: json.dumps would refuse to write it
HOSTILE = {
    "invalid-json": (b"{not json", 400, "not valid JSON"),
    "not-utf8": (b"\xff\xfe\xfa", 400, "UTF-8"),
    "huge": (b'{"model": "x", "messages": "' + b"a" * (2 << 20) + b'"}', 413, "over"),
    "no-model": (json.dumps({"messages": MESSAGES}).encode(), 400, "model"),
    "no-messages": (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
    "not-object": (json.dumps([1, 2]).encode(), 400, "JSON object"),
    "surrogate-content": (
        b'{"model": "%s", "messages": [{"role": "user", "content": %s}]}'
        % (MODEL.encode(), SURROGATE),
        400,
        "surrogate",
    ),
    "surrogate-model": (b'{"model": %s, "messages": []}' % SURROGATE, 400, "surrogate"),
    "surrogate-stop": (_chat()[:-1] + b', "stop": [%s]}' % SURROGATE, 400, "surrogate"),
    "surrogate-task-type": (_chat()[:-1] + b', "task_type": %s}' % SURROGATE, 400, "surrogate"),
    "priority-infinity": (_chat()[:-1] + b', "priority": Infinity}', 400, "priority"),
    "priority-nan": (_chat()[:-1] + b', "priority": NaN}', 400, "priority"),
    "priority-1e30": (_chat(priority=1e30), 400, "priority"),
    "priority-2**40": (_chat(priority=2**40), 400, "priority"),
    "sla-infinity": (_chat()[:-1] + b', "latency_sla_ms": Infinity}', 400, "latency_sla_ms"),
    "task-type-object": (_chat(task_type={"a": 1}), 400, "task_type"),
    "max-tokens-nan": (
        _chat()[:-1].replace(b'"max_tokens": 4', b'"max_tokens": NaN') + b"}",
        400,
        "max_tokens",
    ),
    "temperature-infinity": (_chat()[:-1] + b', "temperature": -Infinity}', 400, "temperature"),
    "deep-nesting": (
        b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        400,
        "nested",
    ),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_malformed_and_hostile_bodies_get_4xx_and_leave_nothing_behind(gateway, name):
    body, status, says = HOSTILE[name]
    url = gateway.url + "/metrics"
    counted = scrape(url, "disagg_gateway_requests_total", status=str(status))
    code, _, err = raw(gateway, "/v1/chat/completions", body)
    assert code == status and says in err["error"]["message"], err
    assert scrape(url, "disagg_gateway_inflight_requests") == 0
    assert scrape(url, "disagg_gateway_requests_total", status=str(status)) == counted + 1


def test_an_admin_weight_of_the_wrong_type_is_a_400(gateway):
    for weight in ("0.5", [0.5], True, {"a": 1}):
        code, _, err = admin(gateway, f"/admin/models/{MODEL}/versions/v2", {"weight": weight})
        assert code == 400 and "weight" in err["error"]["message"], (weight, err)
    code, _, err = admin(gateway, f"/admin/models/{MODEL}/versions/v2", {"state": ["canary"]})
    assert code == 400 and "state" in err["error"]["message"]


def test_a_body_that_stops_midway_gets_408_not_a_hang(gateway):
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer sk-test-beta\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500\r\n\r\n" + b'{"model": "'
        )
        start = time.monotonic()
        answer = sock.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 408"), answer
    assert time.monotonic() - start < 20  # the body timeout is 10 s
    assert scrape(gateway.url + "/metrics", "disagg_gateway_inflight_requests") == 0


def test_a_client_leaving_a_non_streamed_request_cancels_it_cleanly(gateway, stack):
    server = stack[0]
    body = _chat(max_tokens=400, ignore_eos=True)
    host, port = gateway.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer sk-test-beta\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    metric_becomes(server, "disagg_decode_active_sequences", 1.0, timeout_s=30)
    sock.close()  # gone before the answer
    url = gateway.url + "/metrics"
    deadline = time.monotonic() + 15  # 400 tokens would take far longer
    while metric(server, "disagg_decode_active_sequences") or scrape(
        url, "disagg_gateway_inflight_requests"
    ):
        assert time.monotonic() < deadline, "request not cancelled after the client left"
        time.sleep(0.2)
    assert "RuntimeError" not in gateway.log_tail(200)
    assert client_ok(gateway)


def client_ok(gateway) -> bool:
    code, _, reply = raw(gateway, "/v1/chat/completions", _chat())
    return code == 200 and reply["usage"]["completion_tokens"] > 0


def test_request_ids_flow_to_the_router_and_back(gateway, stack):
    server = stack[0]
    code, headers, _ = raw(
        gateway,
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).encode(),
        {"x-request-id": "trace-abc-123", "Content-Type": "application/json"},
    )
    assert code == 200 and headers["x-request-id"] == "trace-abc-123"
    assert headers["x-disagg-model-version"] == "v1"
    assert "request trace-abc-123 " in gateway.log_tail(200)
    assert "request trace-abc-123-" in server.log_path.read_text()  # the router's id extends it


def test_canary_split_and_rollback_without_dropping_streams(gateway, client):
    assert admin(gateway, f"/admin/models/{MODEL}/versions/v2", {"weight": 0.3})[0] == 200
    n, counts, lock = 240, Counter(), threading.Lock()

    def worker(k):
        c = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-test-beta", max_retries=0)
        for _ in range(n // 8):
            r = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=1
            )
            with lock:
                counts[r.headers["x-disagg-model-version"]] += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(counts.values()) == n
    # binomial(240, 0.3): mean 72, sd 7.1; +-4.5 sd
    assert 40 <= counts["v2"] <= 104, counts

    # everything to the canary, start a long stream on it, roll back mid-stream
    admin(gateway, f"/admin/models/{MODEL}/versions/v2", {"weight": 1.0})
    stream = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=48, stream=True, temperature=0.0
    )
    assert stream.headers["x-disagg-model-version"] == "v2"
    chunks = iter(stream.parse())
    first = [next(chunks) for _ in range(3)]
    code, _, body = admin(gateway, f"/admin/models/{MODEL}/rollback")
    assert code == 200 and body["rolled_back"] == ["v2"]
    rest = list(chunks)
    finish = [c.choices[0].finish_reason for c in first + rest if c.choices][-1]
    assert finish in ("stop", "length")  # the in-flight stream finished normally
    after = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=1
    )
    assert after.headers["x-disagg-model-version"] == "v1"


def test_admin_needs_the_admin_key(gateway):
    code, _, body = raw(gateway, f"/admin/models/{MODEL}/rollback", b"{}")
    assert code == 401 and "admin-key" in body["error"]["message"]


def test_a_client_disconnect_frees_the_decode_slot(client, stack):
    server = stack[0]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from 1 to 500, one number per line."}],
        max_tokens=400,
        stream=True,
    )
    for _, _ in zip(range(6), stream, strict=False):
        pass
    metric_becomes(server, "disagg_decode_active_sequences", 1.0)
    stream.close()
    deadline = time.monotonic() + 10  # 400 tokens would take far longer
    while metric(server, "disagg_decode_active_sequences") != 0.0:
        assert time.monotonic() < deadline, "decode slot not freed after the client left"
        time.sleep(0.2)


def test_per_key_request_limit_answers_429_with_retry_after(stack):
    server, _, settings = stack
    (port,) = free_ports(1)
    limited = GatewayProcess(
        replace(settings, gateway_port=port, gateway_rpm=2), env={"DISAGG_API_KEYS": KEYS}
    ).start()
    try:
        limited.wait_ready()
        c = openai.OpenAI(base_url=limited.url + "/v1", api_key="sk-test-alpha", max_retries=0)
        for _ in range(2):
            c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
        assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
        assert e.value.body["code"] == "rate_limit_exceeded"
        other = openai.OpenAI(base_url=limited.url + "/v1", api_key="sk-test-beta", max_retries=0)
        assert other.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    finally:
        limited.stop()


def test_gateway_metrics_count_requests_ttft_and_errors(gateway, client):
    url = gateway.url + "/metrics"
    ok = {"api": "chat", "model": MODEL, "status": "200"}
    before = {
        "ok": scrape(url, "disagg_gateway_requests_total", **ok),
        "ttft": scrape(url, "disagg_gateway_ttft_seconds_count", model=MODEL),
        "e2e": scrape(url, "disagg_gateway_e2e_seconds_count", api="chat", model=MODEL),
        "bad": scrape(url, "disagg_gateway_errors_total", kind="unsupported_parameter"),
    }
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert full.usage.completion_tokens == 12  # ignore_eos: exactly max_tokens
    list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", echo=True)  # unsupported
    assert scrape(url, "disagg_gateway_requests_total", **ok) == before["ok"] + 2
    assert scrape(url, "disagg_gateway_ttft_seconds_count", model=MODEL) == before["ttft"] + 1
    assert scrape(url, "disagg_gateway_e2e_seconds_count", api="chat", model=MODEL) == (
        before["e2e"] + 2
    )
    assert scrape(url, "disagg_gateway_errors_total", kind="unsupported_parameter") == (
        before["bad"] + 1
    )
    assert scrape(url, "disagg_gateway_requests_total", api="chat", status="400") >= 1
    assert scrape(url, "disagg_gateway_inflight_requests") == 0


@pytest.mark.parametrize("via", ["gateway", "triton"])
def test_benchmark_harness_records_real_timelines(stack, via):
    """The harness's open loop against this server, through the gateway (OpenAI client) and
    straight to Triton's router over gRPC: every request's tokens, counts and times."""
    import asyncio

    from disagg.bench.runner import GatewayTarget, TritonTarget, run_open_loop
    from disagg.bench.workloads import RequestSpec

    server, gateway, settings = stack
    specs = [
        RequestSpec(i, cls, arrival_s=0.2 * i, prompt_tokens=0, max_tokens=n, hints=hints)
        for i, (cls, n, hints) in enumerate(
            [("a", 6, {}), ("b", 9, {"latency_sla_ms": 150.0}), ("a", 4, {})]
        )
    ]

    async def main():
        if via == "gateway":
            target = GatewayTarget(gateway.url, MODEL, "sk-test-alpha")
        else:
            target = TritonTarget(f"127.0.0.1:{settings.grpc_port}", "router")
        try:
            return await run_open_loop(target, specs, lambda s: f"Say hello number {s.index}.")
        finally:
            await target.close()

    timelines = asyncio.run(main())
    assert [t.cls for t in timelines] == ["a", "b", "a"]
    for spec, t in zip(specs, timelines, strict=True):
        assert t.ok, t.error
        assert t.output_tokens == spec.max_tokens  # ignore_eos: exactly max_tokens
        assert 5 <= t.prompt_tokens < 40
        assert 0 < t.ttft < t.e2e and t.tpot > 0
        assert t.chunk_s == sorted(t.chunk_s)
        if via == "triton":  # tokens per chunk known from the cumulative count
            assert sum(t.chunk_tokens) == spec.max_tokens
    assert timelines[1].send_s - timelines[0].send_s == pytest.approx(0.2, abs=0.1)  # open loop


def test_last_a_clean_shutdown_crashes_no_stub(stack):
    """Runs last in this module (no fault was injected here): stopping the server must not
    crash a single stub. Before the fix every stub with metrics segfaulted at each shutdown."""
    server = stack[0]
    from disagg.serve.supervisor import stub_processes

    stubs = list(stub_processes(server.proc.pid))
    assert len(stubs) >= 7
    server.stop()
    log = server.log_path.read_text(errors="replace")
    # faulthandler (on in every stub) names each crash. One stub sometimes aborts at exit
    # ("terminate called without an active exception": a C++ thread object destroyed
    # unjoined) after its model unloaded; a residual, noted in docs/reliability.md
    assert "Fatal Python error: Segmentation fault" not in log, log[-3000:]
    from disagg.process import process_alive

    assert not any(process_alive(p) for p in stubs)  # gone, or a zombie of an init that reaps
