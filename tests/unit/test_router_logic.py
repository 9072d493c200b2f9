"""The router's decisions and fallbacks with scripted endpoints and a scripted local pipeline
(tests/helpers/scripted.py): no sockets, no processes. The same rules against a real HTTP
endpoint are in tests/integration/test_lpu_endpoint.py, with the real pipeline in
test_router.py."""

from __future__ import annotations

import pytest
from helpers.scripted import ScriptedEndpoint, ScriptedLocal

from disagg import contracts as C
from disagg.contracts import FINISH_ERROR, RoutedReply
from disagg.routing.endpoint import ChatRequest
from disagg.routing.policy import PolicySource, RouteFeatures
from disagg.routing.router import Router, RouteRequest, RouterEvents

pytestmark = pytest.mark.unit

POLICY = """
default = "local"
[targets.local]
kind = "triton"
[targets.lpu]
kind = "openai"
endpoints = ["first", "second"]
fallback = "local"
[endpoints.first]
base_url = "http://127.0.0.1:9/v1"
[endpoints.second]
base_url = "http://127.0.0.1:9/v1"
[[rules]]
name = "interactive"
when = { latency_sla_ms_below = 200 }
target = "lpu"
"""
HELLO = ChatRequest(messages=[{"role": "user", "content": "hello"}], max_tokens=5)


class Recorder(RouterEvents):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def decision(self, target, reason):
        self.calls.append(("decision", target, reason))

    def fallback(self, planned, cause):
        self.calls.append(("fallback", planned, cause))

    def endpoint_error(self, endpoint, kind):
        self.calls.append(("endpoint_error", endpoint, kind))

    def retry(self, endpoint):
        self.calls.append(("retry", endpoint))


@pytest.fixture
def setup(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    endpoints: dict[str, ScriptedEndpoint] = {}

    def factory(config):
        endpoints[config.name] = ScriptedEndpoint(config)
        return endpoints[config.name]

    local, events = ScriptedLocal(), Recorder()
    router = Router(
        PolicySource(path), local, lambda t: len(t.split()), events, endpoint_factory=factory
    )
    for name in ("first", "second"):  # made up front so a test can script them
        router.endpoint(router.policy.current(), name)
    return router, endpoints, local, events


def request(stream=True, sla: float | None = 100.0, chat=HELLO, **kw) -> RouteRequest:
    return RouteRequest(
        request_id="r1",
        features=RouteFeatures("smollm2", latency_sla_ms=sla, max_tokens=5, prompt_tokens=3),
        local_fields={C.STREAM: stream},
        chat=chat,
        stream=stream,
        **kw,
    )


def serve(router, req, is_cancelled=lambda: False):
    deltas: list[str] = []
    final = router.run(req, lambda r: deltas.append(r.text), is_cancelled)
    return final, deltas


def test_a_rule_sends_the_request_to_the_first_endpoint(setup):
    router, endpoints, local, events = setup
    final, deltas = serve(router, request())
    assert (final.target, final.reason, final.served_by) == ("lpu", "interactive", "first")
    assert "".join(deltas) == ScriptedEndpoint.text and final.finish_reason == "stop"
    assert (final.num_input_tokens, final.num_output_tokens) == (3, 3)  # the endpoint's usage
    assert local.calls == [] and events.calls[-1] == ("decision", "lpu", "interactive")


def test_without_a_matching_rule_the_default_serves_locally(setup):
    router, endpoints, local, _ = setup
    final, deltas = serve(router, request(sla=None))
    assert (final.target, final.reason, final.served_by) == ("local", "default", "disaggregated")
    assert "".join(deltas) == "local answer" and endpoints["first"].requests == []


def test_a_failure_before_any_text_tries_the_next_endpoint(setup):
    router, endpoints, local, events = setup
    endpoints["first"].script = [("fail", "server_error")]
    final, _ = serve(router, request())
    assert final.served_by == "second" and local.calls == []
    assert ("endpoint_error", "first", "server_error") in events.calls
    assert ("retry", "second") in events.calls


def test_when_every_endpoint_fails_the_local_fallback_serves_it(setup):
    router, endpoints, local, events = setup
    endpoints["first"].script = [("fail", "timeout")]
    endpoints["second"].script = [("fail", "timeout")]
    final, deltas = serve(router, request())
    assert (final.target, final.reason) == ("local", "endpoint_failed")
    assert "".join(deltas) == "local answer" and local.calls == ["r1"]
    assert ("fallback", "lpu", "endpoint_failed") in events.calls


def test_unavailable_endpoints_are_skipped_and_the_cause_is_said(setup):
    router, endpoints, _, _ = setup
    endpoints["first"].script = [("unavailable", "circuit_open")]
    endpoints["second"].script = [("unavailable", "circuit_open")]
    final, _ = serve(router, request())
    assert (final.target, final.reason) == ("local", "circuit_open")
    assert endpoints["first"].requests == [] and endpoints["second"].requests == []


def test_a_failure_after_text_was_sent_ends_the_request_with_an_error(setup):
    """The client has part of the answer: serving it again elsewhere would duplicate it."""
    router, endpoints, local, _ = setup
    endpoints["first"].script = [("cut", 2, "stream_cut")]
    final, deltas = serve(router, request())
    assert final.finish_reason == FINISH_ERROR and "stream_cut" in final.error
    assert "".join(deltas) == "scripted endpoint" and local.calls == []


def test_a_non_streaming_request_falls_back_even_after_the_endpoint_sent_text(setup):
    router, endpoints, local, _ = setup
    endpoints["first"].script = [("cut", 2, "stream_cut")]
    endpoints["second"].script = [("fail", "rate_limited")]
    final, deltas = serve(router, request(stream=False))
    assert deltas == [] and final.text == "local answer" and local.calls == ["r1"]


def test_a_request_an_endpoint_cannot_express_stays_local(setup):
    router, endpoints, local, _ = setup
    req = request(chat=None, not_for_endpoints=("bad_words",))
    final, _ = serve(router, req)
    assert (final.target, final.reason) == ("local", "unsupported_request")
    assert endpoints["first"].requests == []


def test_a_client_cancel_reaches_the_local_pipeline(setup):
    router, _, local, _ = setup
    final, deltas = serve(router, request(sla=None), is_cancelled=lambda: True)
    assert local.cancelled == ["r1"] and deltas == ["local "]  # nothing emitted after it
    assert isinstance(final, RoutedReply)


def test_endpoint_tool_call_deltas_are_read_checked_and_merged_into_calls():
    import json

    from disagg.routing.endpoint import EndpointError, OpenAIEndpoint
    from disagg.tool_deltas import merge_tool_calls

    def chunk(delta):
        return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})

    first = {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city"'}}  # fmt: skip
    ev = OpenAIEndpoint._parse_chunk(chunk({"tool_calls": [first]}))
    assert ev.tool_calls == [first] and ev.text == ""
    rest = {"index": 0, "id": None, "function": {"name": None, "arguments": ': "Paris"}'}}
    calls: dict = {}
    merge_tool_calls(calls, [first])
    merge_tool_calls(calls, OpenAIEndpoint._parse_chunk(chunk({"tool_calls": [rest]})).tool_calls)
    assert calls[0]["id"] == "call_1" and calls[0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}  # fmt: skip
    for bad in ([{"id": "x"}], [{"index": 0, "function": {"arguments": 5}}], {"index": 0}):
        with pytest.raises(EndpointError, match="malformed"):
            OpenAIEndpoint._parse_chunk(chunk({"tool_calls": bad}))


def test_a_chat_request_with_tools_sends_them_as_the_client_did():
    tools = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
             "parallel_tool_calls": None}  # fmt: skip
    body = ChatRequest([{"role": "user", "content": "hi"}], 8, tools=tools).body("m")
    assert body["tools"] == tools["tools"] and body["tool_choice"] == "auto"
    assert "parallel_tool_calls" not in body  # not sent: not set
