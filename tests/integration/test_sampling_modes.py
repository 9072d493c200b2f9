"""The API agents use, in the modes other than disaggregated (test_sampling_gateway.py
serves that one in full): co-located, where decode prefills and samples the first token
itself, and conditional, which decides per request. One real tritonserver per mode, the
official `openai` client through the gateway."""

from __future__ import annotations

import json

import pytest
from helpers.schemas import MODELS, WEATHER_TOOL
from helpers.triton_server import openai_client, start_server

pytestmark = pytest.mark.integration
KEY = "sk-test-modes"
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


@pytest.fixture(scope="module", params=["colocated", "conditional"])
def client(request, engine_dir, tmp_path_factory):
    server = start_server(engine_dir, tmp_path_factory.mktemp(request.param), mode=request.param)
    try:
        with openai_client(server, KEY) as client:
            yield client
    finally:
        server.stop()


def test_structured_outputs_parse_in_every_mode(client):
    for model, ask in MODELS[:4]:
        reply = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": ask + " Answer as JSON."}],
            response_format=model, max_tokens=400,
        )  # fmt: skip
        assert type(reply.choices[0].message.parsed) is model, reply.choices[0].message.content


def test_a_required_tool_call_parses_whole_and_streamed_in_every_mode(client):
    ask = [{"role": "user", "content": "Weather in Rome, in celsius?"}]
    # (each request its own cache_salt: both prefill the whole prompt, so greedy takes the
    # same arithmetic; a prefix-cache hit computes the last block with other kernels)
    reply = client.chat.completions.create(
        model=MODEL, messages=ask, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=80,
        extra_body={"cache_salt": "tool-whole"},
    ).choices[0]  # fmt: skip
    assert reply.finish_reason == "tool_calls", reply.message
    args = json.loads(reply.message.tool_calls[0].function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    stream = client.chat.completions.create(
        model=MODEL, messages=ask, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=80,
        stream=True, extra_body={"cache_salt": "tool-streamed"},
    )  # fmt: skip
    deltas = [d for c in stream if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    calls = reply.message.tool_calls  # (parallel calls allowed: each index streams its own)
    assert {d.index for d in deltas} == set(range(len(calls)))
    for i, call in enumerate(calls):  # greedy: the same calls
        streamed = "".join(d.function.arguments or "" for d in deltas if d.index == i)
        assert json.loads(streamed) == json.loads(call.function.arguments)


def test_logprobs_and_seeded_choices_in_every_mode(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, logprobs=True, top_logprobs=2
    ).choices[0]
    content = whole.logprobs.content
    assert "".join(t.token for t in content) == whole.message.content
    assert all(t.top_logprobs[0].token == t.token for t in content)  # greedy: its own top-1
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 10, "n": 3}
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"cache_salt": "n-first"}, **sampled
    )
    again = client.chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"cache_salt": "n-again"}, **sampled
    )
    texts = [c.message.content for c in first.choices]
    assert [c.message.content for c in again.choices] == texts and len(texts) == 3
