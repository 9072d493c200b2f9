"""The LPU endpoint client and the router's fallback logic against a fault-injecting
OpenAI-compatible server on loopback (tests/helpers/fake_openai.py: it stands for the paid
external API). The local pipeline is scripted (tests/helpers/scripted.py); test_router.py
runs the real one in Triton."""

from __future__ import annotations

import time

import pytest
from helpers.fake_openai import CANNED, FakeOpenAI
from helpers.scripted import ScriptedLocal

from disagg.contracts import FINISH_ERROR
from disagg.routing import endpoint as E
from disagg.routing.endpoint import ChatRequest, EndpointError, OpenAIEndpoint
from disagg.routing.policy import EndpointConfig, PolicySource, RouteFeatures
from disagg.routing.router import Router, RouteRequest

pytestmark = pytest.mark.integration
KEY_ENV = "DISAGG_TEST_ENDPOINT_KEY"
KEY = "sk-test-7f3a9c"
HELLO = ChatRequest(messages=[{"role": "user", "content": "hello"}], max_tokens=5)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    with FakeOpenAI(KEY) as f:
        yield f


def endpoint(fake, **kw) -> OpenAIEndpoint:
    cfg = dict(
        base_url=fake.base_url,
        api_key_env=KEY_ENV,
        connect_timeout_s=1.0,
        first_token_timeout_s=0.5,
        idle_timeout_s=0.5,
        total_timeout_s=5.0,
        failure_threshold=2,
        cooldown_s=0.3,
    )
    cfg.update(kw)
    return OpenAIEndpoint(EndpointConfig(name="lpu", **cfg))


def run(ep: OpenAIEndpoint, req: ChatRequest = HELLO) -> tuple[str, str | None, dict]:
    text, finish, usage = "", None, {}
    for ev in ep.stream_chat("smollm2", req):
        text += ev.text
        finish, usage = ev.finish_reason or finish, ev.usage or usage
    return text, finish, usage


def test_streams_text_finish_reason_and_usage_with_the_key_from_the_environment(fake):
    text, finish, usage = run(endpoint(fake))
    assert text == " ".join(CANNED.split()[:5])
    assert finish == "length" and usage["completion_tokens"] == 5
    assert fake.auth_headers == [f"Bearer {KEY}"]
    body = fake.requests[0]
    assert body["model"] == "smollm2" and body["stream"] is True and body["max_tokens"] == 5


def test_model_names_are_mapped_and_unmapped_models_are_not_sent(fake):
    ep = endpoint(fake, models={"smollm2": "llama-3.1-8b-instant"})
    run(ep)
    assert fake.requests[0]["model"] == "llama-3.1-8b-instant"
    assert ep.unavailable_reason("other-model", 10) == "model_not_mapped"


def test_no_key_means_unavailable(fake, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    assert endpoint(fake).unavailable_reason("smollm2", 10) == "no_credentials"


def test_key_from_a_secret_file(fake, tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    secret = tmp_path / "key"
    secret.write_text(KEY + "\n")
    ep = endpoint(fake, api_key_env="", api_key_file=str(secret))
    assert ep.unavailable_reason("smollm2", 10) is None
    run(ep)
    assert fake.auth_headers == [f"Bearer {KEY}"]


@pytest.mark.parametrize(
    "behaviour, kind",
    [
        (
            ("status", 429, {"retry-after": "2"}, {"error": {"message": "slow down"}}),
            E.RATE_LIMITED,
        ),
        (("status", 498, {}, {"error": {"message": "capacity"}}), E.CAPACITY),
        (("status", 500, {}, {"error": {"message": "boom"}}), E.SERVER_ERROR),
        (("status", 502, {}, "bad gateway"), E.SERVER_ERROR),
        (("status", 503, {}, {"error": {"message": "down"}}), E.SERVER_ERROR),
        (("status", 400, {}, {"error": {"message": "bad param"}}), E.REJECTED),
        ("hang", E.TIMEOUT),
        ("cut", E.CONNECTION),
        ("malformed", E.PROTOCOL),
    ],
)
def test_each_fault_is_a_typed_error(fake, behaviour, kind):
    fake.push(behaviour)
    with pytest.raises(EndpointError) as e:
        run(endpoint(fake))
    assert e.value.kind == kind


def test_first_token_timeout_is_measured_from_the_request(fake):
    fake.push("hang")
    start = time.monotonic()
    with pytest.raises(EndpointError, match="no first token within 0.5 s"):
        run(endpoint(fake))
    assert 0.4 < time.monotonic() - start < 3


def test_connection_refused_is_a_connection_error():
    cfg = EndpointConfig(name="x", base_url="http://127.0.0.1:9/v1", api_key_env=KEY_ENV)
    with pytest.raises(EndpointError) as e:
        list(OpenAIEndpoint(cfg)._stream(KEY, "m", HELLO))
    assert e.value.kind == E.CONNECTION


def test_429_retry_after_blocks_the_endpoint_until_it_passes(fake):
    ep = endpoint(fake)
    fake.push(("status", 429, {"retry-after": "0.4"}, {"error": {"message": "limit"}}))
    with pytest.raises(EndpointError):
        run(ep)
    assert ep.unavailable_reason("smollm2", 10) == E.RATE_LIMITED
    time.sleep(0.45)
    assert ep.unavailable_reason("smollm2", 10) is None
    assert ep.breaker.state == "closed"  # a budget answer says nothing about health


def test_ratelimit_headers_of_a_successful_answer_are_honoured(fake):
    fake.ok_headers = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m"}
    ep = endpoint(fake)
    run(ep)
    assert ep.unavailable_reason("smollm2", 10) == E.RATE_LIMITED


def test_the_key_is_redacted_from_error_messages(fake):
    fake.push("echo_key_401")
    with pytest.raises(EndpointError) as e:
        run(endpoint(fake))
    assert KEY not in str(e.value) and "***" in str(e.value) and e.value.kind == E.AUTH


def test_circuit_opens_after_failures_and_a_probe_closes_it(fake):
    ep = endpoint(fake)
    fake.push(*[("status", 503, {}, "down")] * 2)
    for _ in range(2):
        with pytest.raises(EndpointError):
            run(ep)
    assert ep.unavailable_reason("smollm2", 10) == "circuit_open"
    time.sleep(0.35)
    assert ep.unavailable_reason("smollm2", 10) is None  # half-open: this is the probe
    run(ep)
    assert ep.breaker.state == "closed"


# ------------------------------------------------------------------ router fallback logic


POLICY = """
default = "local"
[targets.local]
kind = "triton"
[targets.lpu]
kind = "openai"
endpoints = [{endpoints}]
fallback = "local"
{tables}
[[rules]]
name = "interactive"
when = {{ latency_sla_ms_below = 200 }}
target = "lpu"
"""


def make_router(tmp_path, fakes: dict[str, FakeOpenAI]):
    tables = "".join(
        f'[endpoints.{n}]\nbase_url = "{f.base_url}"\napi_key_env = "{KEY_ENV}"\n'
        "first_token_timeout_s = 0.5\nidle_timeout_s = 0.5\nfailure_threshold = 2\n"
        for n, f in fakes.items()
    )
    path = tmp_path / "policy.toml"
    names = ", ".join(f'"{n}"' for n in fakes)
    path.write_text(POLICY.format(endpoints=names, tables=tables))
    local = ScriptedLocal()
    return Router(PolicySource(path), local, count_tokens=lambda t: len(t.split())), local


def request(stream: bool, sla: float | None = 100.0) -> RouteRequest:
    return RouteRequest(
        request_id="r1",
        features=RouteFeatures("smollm2", latency_sla_ms=sla, max_tokens=5, prompt_tokens=3),
        local_fields={"stream": stream},
        chat=HELLO,
        stream=stream,
    )


def serve(router, req):
    deltas: list[str] = []
    final = router.run(req, emit=lambda r: deltas.append(r.text))
    return final, deltas


def test_routes_by_rule_to_the_endpoint_and_by_default_locally(fake, tmp_path):
    router, local = make_router(tmp_path, {"groq": fake})
    final, deltas = serve(router, request(stream=True))
    assert (final.target, final.reason, final.served_by) == ("lpu", "interactive", "groq")
    assert "".join(deltas) == " ".join(CANNED.split()[:5])
    assert final.num_output_tokens == 5 and final.finish_reason == "length"
    final, _ = serve(router, request(stream=False, sla=None))
    assert (final.target, final.reason, final.text) == ("local", "default", "local answer")


@pytest.mark.parametrize("fault", ["hang", "malformed", "cut", ("status", 503, {}, "down")])
def test_a_failure_before_any_text_reached_the_client_falls_back_locally(fake, tmp_path, fault):
    router, local = make_router(tmp_path, {"groq": fake})
    fake.push(fault)
    # "cut" and "malformed" fail after the first chunk: non-streaming, nothing was sent yet
    final, deltas = serve(router, request(stream=False))
    assert (final.target, final.text, final.finish_reason) == ("local", "local answer", "stop")
    assert final.reason.startswith("endpoint_failed") and len(local.calls) == 1
    assert fake.num_requests == 1  # tried once, then served locally: nothing lost or doubled


def test_a_failure_after_text_was_streamed_ends_with_finish_reason_error(fake, tmp_path):
    router, local = make_router(tmp_path, {"groq": fake})
    fake.push("cut")
    final, deltas = serve(router, request(stream=True))
    assert deltas == ["The", " quick"]  # what the client already has
    assert final.finish_reason == FINISH_ERROR and "endpoint groq failed" in final.error
    assert local.calls == []  # not served twice


def test_the_next_endpoint_of_the_pool_is_tried_before_falling_back(monkeypatch, tmp_path):
    monkeypatch.setenv(KEY_ENV, KEY)
    with FakeOpenAI(KEY) as bad, FakeOpenAI(KEY) as good:
        bad.push(("status", 502, {}, "bad gateway"))
        router, local = make_router(tmp_path, {"bad": bad, "good": good})
        retried = []
        router.events.retry = retried.append
        final, _ = serve(router, request(stream=False))
    assert (final.target, final.served_by, final.reason) == ("lpu", "good", "interactive")
    assert local.calls == []
    assert retried == ["good"]  # counted as disagg_router_retries_total{endpoint="good"}


def test_open_circuit_and_spent_budget_skip_the_endpoint_without_calling_it(fake, tmp_path):
    router, local = make_router(tmp_path, {"groq": fake})
    fake.push(*[("status", 503, {}, "down")] * 2)
    for _ in range(2):
        assert serve(router, request(stream=False))[0].target == "local"
    final, _ = serve(router, request(stream=False))
    assert (final.target, final.reason) == ("local", "circuit_open")
    assert fake.num_requests == 2

    router, local = make_router(tmp_path, {"groq2": fake})
    fake.push(("status", 429, {"retry-after": "30"}, "limit"))
    serve(router, request(stream=False))
    final, _ = serve(router, request(stream=False))
    assert (final.target, final.reason) == ("local", "rate_limited")
    assert fake.num_requests == 3


def test_requests_an_endpoint_cannot_honour_stay_local(fake, tmp_path):
    router, local = make_router(tmp_path, {"groq": fake})
    req = request(stream=False)
    req = RouteRequest(**{**req.__dict__, "chat": None, "not_for_endpoints": ("top_k",)})
    final, _ = serve(router, req)
    assert (final.target, final.reason) == ("local", "unsupported_request")
    assert fake.num_requests == 0
