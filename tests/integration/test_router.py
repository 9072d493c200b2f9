"""The router model in a real tritonserver: policy rules, the local pipeline, and external
OpenAI-compatible endpoints on loopback. Those endpoints are tests/fake_openai.py servers:
they stand for the paid external API (Groq), one streaming canned text with scripted faults,
one streaming real SmolLM2 text from the engine in this process."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import openai
import pytest
from helpers.fake_openai import CANNED, TOOL_ARGS, FakeOpenAI
from helpers.triton_server import metric, metric_becomes, start_server

from disagg import contracts as C
from disagg.client import GenerateError, GrpcClient, HttpClient
from disagg.engine.sequence import SamplingParams
from disagg.serve.gateway_process import GatewayProcess
from disagg.serve.server import free_ports

pytestmark = pytest.mark.integration
KEY_ENV = "DISAGG_TEST_LPU_KEY"
KEY = "gsk-test-0d9e8f7a6b5c"  # a made-up key: it must reach the endpoints and no log
PROMPT = "What is the capital of France?"

POLICY = """
default = "local"

[targets.local]
kind = "triton"
model = "orchestrator"

[targets.lpu]
kind = "openai"
endpoints = ["faulty"]
fallback = "local"

[targets.real_lpu]
kind = "openai"
endpoints = ["real"]
fallback = "local"

[targets.flaky_lpu]
kind = "openai"
endpoints = ["flaky"]
fallback = "local"

[endpoints.faulty]
base_url = "{faulty}"
api_key_env = "{env}"
first_token_timeout_s = 1.0
idle_timeout_s = 1.0
failure_threshold = 1000

[endpoints.real]
base_url = "{real}"
api_key_env = "{env}"
models = {{ "smollm2-135m-instruct" = "smollm2-on-another-box" }}

[endpoints.flaky]
base_url = "{flaky}"
api_key_env = "{env}"
failure_threshold = 2
cooldown_s = 2.0

[[rules]]
name = "offline"
when = {{ task_type = "batch_offline" }}
target = "local"

[[rules]]
name = "interactive"
when = {{ latency_sla_ms_below = 200, max_tokens_below = 2048 }}
target = "lpu"

[[rules]]
name = "real"
when = {{ task_type = "real" }}
target = "real_lpu"

[[rules]]
name = "flaky"
when = {{ task_type = "flaky" }}
target = "flaky_lpu"
"""


def real_text(llm):
    """The "real" endpoint answers with the engine's own greedy text for the messages."""

    def generate(body):
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"])
        yield from llm.stream(body["messages"], params)

    return generate


@pytest.fixture(scope="module")
def setup(engine_dir, llm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    with (
        FakeOpenAI(KEY) as faulty,
        FakeOpenAI(KEY, generate=real_text(llm)) as real,
        FakeOpenAI(KEY) as flaky,
    ):
        policy = tmp / "policy.toml"
        policy.write_text(
            POLICY.format(
                faulty=faulty.base_url, real=real.base_url, flaky=flaky.base_url, env=KEY_ENV
            )
        )
        os.environ[KEY_ENV] = KEY  # the server's environment is copied at start
        try:
            server = start_server(engine_dir, tmp / "triton", router_policy=str(policy))
        finally:
            del os.environ[KEY_ENV]
        try:
            yield server, {"faulty": faulty, "real": real, "flaky": flaky}, policy
        finally:
            server.stop()


@pytest.fixture(scope="module")
def server(setup):
    return setup[0]


@pytest.fixture(scope="module")
def fakes(setup):
    return setup[1]


@pytest.fixture(scope="module")
def grpc(server):
    client = GrpcClient(server.endpoints.grpc, timeout_s=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http(server):
    return HttpClient(server.endpoints.http, timeout_s=120)


def chat(prompt: str = PROMPT, max_tokens: int = 16, **kw) -> dict:
    return {
        C.TEXT_INPUT: prompt,
        C.APPLY_CHAT_TEMPLATE: True,
        C.MAX_TOKENS: max_tokens,
        C.EXCLUDE_INPUT_IN_OUTPUT: True,
        **kw,
    }


def route(r) -> tuple[str, str, str]:
    return r.extra[C.ROUTE_TARGET], r.extra[C.ROUTE_REASON], r.extra[C.SERVED_BY]


def canned(n: int) -> str:
    return " ".join(CANNED.split()[:n])


def test_by_default_the_router_serves_what_the_ensemble_serves(grpc, http):
    routed = grpc.generate("router", chat())
    assert routed.text == http.generate("ensemble", chat()).text
    assert route(routed) == ("local", "default", "disaggregated")
    assert http.generate("router", chat()).text == routed.text  # generate endpoint, too
    streamed = http.generate("router", chat(), stream=True)  # and generate_stream, whose
    assert streamed.text == routed.text  # final event carries an empty `error`


def test_router_sync_answers_kserve_infer(server, http):
    import numpy as np
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.endpoints.http.removeprefix("http://"))
    inputs = []
    for name, arr, dtype in [
        (C.TEXT_INPUT, np.array([[PROMPT.encode()]], dtype=np.object_), "BYTES"),
        (C.MAX_TOKENS, np.array([[16]], dtype=np.int32), "INT32"),
        (C.APPLY_CHAT_TEMPLATE, np.array([[True]]), "BOOL"),
        (C.EXCLUDE_INPUT_IN_OUTPUT, np.array([[True]]), "BOOL"),
    ]:
        t = httpclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    out = client.infer("router_sync", inputs)
    assert (
        out.as_numpy(C.TEXT_OUTPUT).reshape(-1)[0].decode() == http.generate("router", chat()).text
    )
    assert out.as_numpy(C.ROUTE_TARGET).reshape(-1)[0] == b"local"


def test_latency_critical_requests_go_to_the_lpu_endpoint(grpc, fakes):
    before = fakes["faulty"].num_requests
    r = grpc.generate("router", chat(max_tokens=6, latency_sla_ms=100.0))
    assert route(r) == ("lpu", "interactive", "faulty")
    assert r.text == canned(6) and len(r.deltas) == 6
    assert r.num_output_tokens == 6  # the endpoint's usage, reported like the local one's
    assert fakes["faulty"].num_requests == before + 1
    assert fakes["faulty"].auth_headers[-1] == f"Bearer {KEY}"
    sent = fakes["faulty"].requests[-1]
    assert sent["messages"] == [{"role": "user", "content": PROMPT}] and sent["max_tokens"] == 6


def test_an_offline_task_stays_local_even_with_a_tight_sla(grpc):
    r = grpc.generate("router", chat(task_type="batch_offline", latency_sla_ms=50.0))
    assert route(r)[:2] == ("local", "offline")


def test_an_endpoint_streaming_real_text(grpc, fakes):
    r = grpc.generate("router", chat(task_type="real", max_tokens=24))
    assert route(r) == ("real_lpu", "real", "real")
    assert fakes["real"].requests[-1]["model"] == "smollm2-on-another-box"
    local = grpc.generate("router", chat(max_tokens=24))
    assert r.text == local.text and len(r.text) > 20  # the same model, greedy: the same text
    assert r.num_output_tokens == len(r.deltas)  # what this endpoint's usage reports


@pytest.mark.parametrize(
    "fault",
    [
        ("status", 498, {}, {"error": {"message": "capacity exceeded"}}),
        ("status", 503, {}, {"error": {"message": "service unavailable"}}),
        ("status", 500, {}, {"error": {"message": "internal"}}),
        "hang",
    ],
    ids=["498", "503", "500", "hang"],
)
def test_a_failing_endpoint_falls_back_to_the_local_pipeline(grpc, fakes, fault):
    fakes["faulty"].push(fault)
    before = fakes["faulty"].num_requests
    r = grpc.generate("router", chat(latency_sla_ms=100.0))
    assert route(r) == ("local", "endpoint_failed", "disaggregated")
    assert r.text == grpc.generate("router", chat()).text  # the full local answer, once
    assert fakes["faulty"].num_requests == before + 1
    time.sleep(1.1)  # a 498 backs the endpoint off for a second


def test_429_with_retry_after_skips_the_endpoint_until_it_passes(grpc, fakes):
    fakes["faulty"].push(("status", 429, {"retry-after": "2"}, {"error": {"message": "limit"}}))
    assert route(grpc.generate("router", chat(latency_sla_ms=100.0)))[:2] == (
        "local",
        "endpoint_failed",
    )
    n = fakes["faulty"].num_requests
    r = grpc.generate("router", chat(latency_sla_ms=100.0))
    assert route(r)[:2] == ("local", "rate_limited") and fakes["faulty"].num_requests == n
    time.sleep(2.1)
    assert route(grpc.generate("router", chat(latency_sla_ms=100.0)))[2] == "faulty"


@pytest.mark.parametrize("fault", ["cut", "malformed"])
def test_a_broken_stream_falls_back_while_nothing_was_sent(http, fakes, fault):
    fakes["faulty"].push(fault)
    r = http.generate("router", chat(latency_sla_ms=100.0))  # not streaming
    assert r.extra[C.ROUTE_TARGET] == "local" and r.finish_reason in ("stop", "length")
    assert r.text == http.generate("router", chat()).text


def test_a_stream_cut_after_text_was_sent_ends_with_a_clear_error(grpc, fakes):
    fakes["faulty"].push("cut")
    r = grpc.generate("router", chat(latency_sla_ms=100.0))
    assert r.text == canned(2)  # what was sent stays; nothing is served twice
    assert r.finish_reason == "error" and "endpoint faulty failed" in r.extra["error"]


def test_the_circuit_opens_after_failures_and_closes_after_a_good_probe(grpc, fakes, server):
    flaky = fakes["flaky"]
    # short local fallbacks: the circuit's 2 s cooldown must not pass before the third request
    flaky.push(*[("status", 503, {}, {C.ERROR: {"message": "down"}})] * 2)
    for _ in range(2):
        assert (
            route(grpc.generate("router", chat(max_tokens=2, task_type="flaky")))[1]
            == "endpoint_failed"
        )
    n = flaky.num_requests
    r = grpc.generate("router", chat(max_tokens=2, task_type="flaky"))
    assert route(r)[:2] == ("local", "circuit_open") and flaky.num_requests == n
    time.sleep(2.1)  # the cooldown
    assert (
        route(grpc.generate("router", chat(max_tokens=2, task_type="flaky")))[2] == "flaky"
    )  # the probe
    assert (
        route(grpc.generate("router", chat(max_tokens=2, task_type="flaky")))[2] == "flaky"
    )  # closed
    metric_becomes(
        server, "disagg_router_fallbacks_total", 1, target="flaky_lpu", cause="circuit_open"
    )


def test_fields_an_endpoint_cannot_honour_keep_the_request_local(grpc, fakes):
    n = fakes["faulty"].num_requests
    r = grpc.generate("router", chat(latency_sla_ms=100.0, top_k=5))
    assert route(r)[:2] == ("local", "unsupported_request")
    assert fakes["faulty"].num_requests == n


def test_bad_input_gets_a_clear_error(grpc):
    with pytest.raises(GenerateError, match="text_input or messages"):
        grpc.generate("router", {C.MAX_TOKENS: 4})
    with pytest.raises(GenerateError, match="latency_sla_ms must be > 0"):
        grpc.generate("router", chat(latency_sla_ms=-1.0))
    with pytest.raises(GenerateError, match="messages is not valid JSON"):
        grpc.generate("router", {C.MESSAGES: "[{", C.MAX_TOKENS: 4})
    assert grpc.generate("router", chat(max_tokens=2)).num_output_tokens == 2


def test_a_cancelled_local_stream_frees_its_decode_slot(grpc, server):
    r = grpc.generate(
        "router", chat("Count from 1 to 500, one number per line.", 400), cancel_after_deltas=4
    )
    assert r.finish_reason == "cancelled"
    deadline = time.monotonic() + 10  # 400 tokens would take far longer
    while metric(server, "disagg_decode_active_sequences") != 0.0:
        assert time.monotonic() < deadline, "decode slot not freed after cancel"
        time.sleep(0.2)


def test_routing_decisions_are_counted(grpc, server):
    before = metric(server, "disagg_router_requests_total", target="local", reason="offline")
    for _ in range(3):
        grpc.generate("router", chat(max_tokens=2, task_type="batch_offline"))
    metric_becomes(
        server, "disagg_router_requests_total", before + 3, target="local", reason="offline"
    )
    assert metric(server, "disagg_router_endpoint_errors_total", endpoint="faulty") >= 4


def test_the_policy_reloads_and_a_broken_file_is_refused(grpc, setup, server):
    _, fakes, policy = setup
    original = policy.read_text()
    try:
        policy.write_text(original.replace('default = "local"', 'default = "lpu"'))
        _wait_for(lambda: route(grpc.generate("router", chat(max_tokens=3)))[0] == "lpu")
        policy.write_text(original + '\n[[rules]]\nname = "broken"\ntarget = "nowhere"\n')
        # the file is checked when requests arrive (at most once a second)
        _wait_for(
            lambda: (
                grpc.generate("router", chat(max_tokens=1))
                and "rule 5 ('broken')" in Path(server.log_path).read_text()
            )
        )
        assert route(grpc.generate("router", chat(max_tokens=3)))[0] == "lpu"  # kept
    finally:
        policy.write_text(original)
    _wait_for(lambda: route(grpc.generate("router", chat(max_tokens=3)))[0] == "local")


def test_the_key_never_shows_in_logs(grpc, fakes, server):
    fakes["faulty"].push("echo_key_401")  # the endpoint's error body repeats the key
    r = grpc.generate("router", chat(latency_sla_ms=100.0))
    assert route(r)[:2] == ("local", "endpoint_failed")
    log = Path(server.log_path).read_text()
    assert "refused (401): bad key in Bearer ***" in log
    assert KEY not in log


def _wait_for(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.3)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


def test_tools_reach_the_endpoint_natively_and_its_calls_come_back_as_tool_calls(server, fakes):
    """Through the gateway (openai client): an endpoint gets the client's tools, tool_choice
    and messages as sent (not the Hermes text the local model gets), and its streamed call
    deltas come back in OpenAI's shape, whole and streamed; a required call goes there too
    (the endpoint's tool_choice does what the local grammar does), history included."""
    (port,) = free_ports(1)
    gateway = GatewayProcess(
        replace(server.settings, gateway_port=port), env={"DISAGG_API_KEYS": "sk-tools"}
    ).start()
    try:
        gateway.wait_ready()
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-tools", max_retries=0)
        ask = [{"role": "user", "content": "What's the weather in Paris?"}]
        kw = {"model": "smollm2-135m-instruct", "tools": [WEATHER_TOOL], "max_tokens": 32,
              "extra_body": {"latency_sla_ms": 100.0}}  # fmt: skip
        whole = client.chat.completions.create(messages=ask, **kw)
        sent = fakes["faulty"].requests[-1]
        assert sent["tools"] == [WEATHER_TOOL] and sent["messages"] == ask
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert (call.id, call.function.name) == ("call_fake0", "get_weather")
        assert call.function.arguments == TOOL_ARGS
        stream = client.chat.completions.create(messages=ask, stream=True, **kw)
        chunks = [c for c in stream if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert len(deltas) == 3 and deltas[0].id == "call_fake0"  # relayed as they came
        assert "".join(d.function.arguments for d in deltas) == TOOL_ARGS
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        history = [
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": "get_weather", "arguments": TOOL_ARGS}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
        ]  # fmt: skip
        before = fakes["faulty"].num_requests
        again = client.chat.completions.create(messages=history, tool_choice="required", **kw)
        assert fakes["faulty"].num_requests == before + 1
        sent = fakes["faulty"].requests[-1]
        assert sent["messages"] == history and sent["tool_choice"] == "required"
        assert json.loads(again.choices[0].message.tool_calls[0].function.arguments)["city"]
    finally:
        gateway.stop()
