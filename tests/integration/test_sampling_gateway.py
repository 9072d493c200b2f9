"""Sampling controls through the gateway with the official `openai` client, against a real
tritonserver serving disaggregated (prefill samples the first token, decode the rest)."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import openai
import pydantic
import pytest
from helpers.schemas import WEATHER_TOOL
from helpers.triton_server import metric, openai_client, start_server

from disagg.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.integration
KEY = "sk-test-sampling"
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    server = start_server(engine_dir, tmp_path_factory.mktemp("sampling"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server, KEY) as client:
        yield client


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=ASK, **{"max_tokens": 16, **kw})


def test_penalties_logit_bias_and_min_tokens_through_the_gateway(client, engine_dir):
    plain = chat(client)
    assert "Paris" in plain.choices[0].message.content
    penalised = chat(client, presence_penalty=1.0, frequency_penalty=1.5)
    assert penalised.choices[0].message.content  # accepted and served
    tok = Tokenizer(engine_dir)
    paris = {ids[0] for w in ("Paris", " Paris") if len(ids := tok.encode(w)) == 1}
    assert paris  # SmolLM2 has Paris as one token
    banned = chat(client, logit_bias={str(t): -100 for t in paris})
    text = banned.choices[0].message.content
    assert not paris & set(tok.encode(text)) and text != plain.choices[0].message.content
    n = plain.usage.completion_tokens
    longer = chat(client, max_tokens=n + 12, extra_body={"min_tokens": n + 6})
    assert longer.usage.completion_tokens >= n + 6
    completion = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=8, extra_body={"repetition_penalty": 1.3}
    )
    assert completion.choices[0].text


def test_bad_sampling_values_get_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, presence_penalty=3)
    assert e.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError, match="logit_bias"):  # refused downstream
        chat(client, logit_bias={"1000000": 5})
    with pytest.raises(openai.BadRequestError, match="disagree"):
        chat(client, max_completion_tokens=5)  # max_tokens=16 too


def test_a_seeded_sampled_reply_is_reproducible_and_every_stream_counts_usage(client):
    sampled = {"temperature": 1.0, "seed": 1234, "max_tokens": 24}
    first = client.chat.completions.create(model=MODEL, messages=ASK, **sampled)
    again = client.chat.completions.create(model=MODEL, messages=ASK, **sampled)
    assert first.choices[0].message.content == again.choices[0].message.content
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The sea is",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices
    assert all(c.usage is None for c in chunks[:-1])


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]
    days: int = pydantic.Field(ge=1, le=14)


WEATHER = [{"role": "user", "content": "Weather in Paris this week? Answer as JSON."}]


def test_structured_outputs_through_every_door(client, server):
    """The openai client's parse() (response_format from a pydantic model), a streamed
    json_object reply, vLLM's structured_outputs on completions, and Triton's generate
    endpoint with TensorRT-LLM's guided_decoding_* inputs."""
    parsed = client.chat.completions.parse(
        model=MODEL, messages=WEATHER, response_format=Weather, max_tokens=60
    )
    weather = parsed.choices[0].message.parsed
    assert isinstance(weather, Weather) and parsed.choices[0].finish_reason == "stop"
    ada = "Return a JSON object with the name and age of a person called Ada who is 36."
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ada}], max_tokens=60, stream=True,
        response_format={"type": "json_object"},
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert json.loads(text) == {"name": "Ada", "age": 36}  # greedy: as in-process
    assert chunks[-1].choices[0].finish_reason == "stop"
    choice = client.completions.create(
        model=MODEL, prompt="The colour of grass is", max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["green", "purple"]}},
    )  # fmt: skip
    assert choice.choices[0].text in ("green", "purple")
    body = {
        "text_input": "Is water wet?", "apply_chat_template": True, "max_tokens": 12,
        "exclude_input_in_output": True, "guided_decoding_guide_type": "regex",
        "guided_decoding_guide": "(Yes|No)!",
    }  # fmt: skip
    url = f"http://127.0.0.1:{server.settings.http_port}/v2/models/ensemble/generate"
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.loads(r.read())["text_output"] in ("Yes!", "No!")


def test_parse_returns_a_valid_object_for_twenty_schemas(client):
    """chat.completions.parse() with 20 pydantic models (nested objects, enums, arrays,
    optional fields): every reply parses and validates, none is cut by max_tokens."""
    from helpers.schemas import MODELS

    failed = []
    for model, ask in MODELS:
        try:
            reply = client.chat.completions.parse(
                model=MODEL, messages=[{"role": "user", "content": ask + " Answer as JSON."}],
                response_format=model, max_tokens=400,
            )  # fmt: skip
        except openai.LengthFinishReasonError as e:  # cut: what it said, for the message
            failed.append((model.__name__, e.completion.choices[0].message.content))
            continue
        choice = reply.choices[0]
        if choice.finish_reason != "stop" or type(choice.message.parsed) is not model:
            failed.append((model.__name__, choice.message.content))
    assert not failed, failed


def test_guides_that_do_not_compile_get_400_naming_the_reason(client):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/x"}}}
    with pytest.raises(openai.BadRequestError, match="does not compile") as e:
        chat(client, response_format=bad_schema)
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="does not compile") as e:
        chat(client, extra_body={"guided_regex": "(unclosed"})
    assert e.value.body["param"] == "guided_regex"
    broken = {**WEATHER_TOOL["function"], "parameters": {"type": "object", "minProperties": "x"}}
    with pytest.raises(openai.BadRequestError) as e:  # even under auto, which needs no grammar
        chat(client, tools=[{"type": "function", "function": broken}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "yaml"})
    assert e.value.body["param"] == "response_format"
    assert "Paris" in chat(client).choices[0].message.content  # the server is unharmed


TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}


def test_tool_calls_whole_streamed_and_answered(client):
    """tool_choice required: the reply is a call whose arguments validate, whole and
    streamed (the client's accumulated deltas); the call and its result sent back as history
    are accepted and answered."""
    tools = [WEATHER_TOOL, TIME_TOOL]
    reply = client.chat.completions.create(
        model=MODEL, messages=WEATHER, tools=tools, tool_choice="required", max_tokens=80
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model=MODEL, messages=WEATHER, tools=tools, tool_choice=named, max_tokens=80,
        stream=True,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather" and deltas[0].id
    streamed = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert set(streamed) == {"city", "unit"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    history = [
        *WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": deltas[0].id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(streamed)}}
        ]},
        {"role": "tool", "tool_call_id": deltas[0].id, "content": "18 C and sunny"},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=tools, max_tokens=40
    )
    message = answer.choices[0].message
    assert message.content or message.tool_calls  # auto: text or a call that parsed
    # the loop's last turn: with the tools still offered but none to call, the model
    # answers in text, whole and streamed alike (greedy: the same text)
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=tools, tool_choice="none", max_tokens=40,
        extra_body={"cache_salt": "final-whole"},  # (both prefill it whole: same arithmetic)
    ).choices[0]  # fmt: skip
    assert final.message.content and not final.message.tool_calls
    assert final.finish_reason in ("stop", "length")
    pieces = client.chat.completions.create(
        model=MODEL, messages=history, tools=tools, tool_choice="none", max_tokens=40,
        stream=True, extra_body={"cache_salt": "final-streamed"},
    )  # fmt: skip
    chunks = [c for c in pieces if c.choices]
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == final.message.content


def test_n_choices_whole_and_streamed_share_one_prefill(client, server):
    """n=4 sampled with a seed: four indexed choices, all different, reproducible, counted
    once for the prompt; streamed, each index's deltas make the same texts; the later
    choices found the prompt in the prefix cache (the request_cached_tokens histogram grew
    by ~3 prompts: each computed only the prompt's last partial block, as vLLM v1's n fans
    out to child requests over its prefix cache)."""
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 12, "n": 4}
    fresh = [{"role": "user", "content": "Name three colours of the rainbow, then stop."}]

    def salted(salt: str) -> dict:  # (each call prefills its first choice whole: the same
        return {**sampled, "extra_body": {"ignore_eos": True, "cache_salt": salt}}  # arithmetic)

    before = metric(server, "disagg_request_cached_tokens_sum")
    whole = client.chat.completions.create(model=MODEL, messages=fresh, **salted("n-whole"))
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) == 4, texts  # seed + i: the choices differ
    assert whole.usage.completion_tokens == 12 * 4
    prompt = whole.usage.prompt_tokens
    cached = metric(server, "disagg_request_cached_tokens_sum") - before
    assert cached >= 3 * (prompt - 16), (cached, prompt)  # all but the last partial block
    again = client.chat.completions.create(model=MODEL, messages=fresh, **salted("n-again"))
    assert [c.message.content for c in again.choices] == texts  # reproducible
    stream = client.chat.completions.create(
        model=MODEL, messages=fresh, stream=True, **salted("n-stream")
    )
    streamed = ["", "", "", ""]
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert streamed == texts and finished == {0, 1, 2, 3}


def test_a_greedy_reply_is_unchanged_beside_penalised_and_guided_neighbours(client):
    """Batch invariance through the server: the same greedy request alone, then decoded in
    one batch with a penalised, a logit-biased and a JSON-guided neighbour (started first,
    longer, so they are running while it decodes), gives the same tokens."""
    greedy = {"max_tokens": 24, "extra_body": {"ignore_eos": True, "cache_salt": "alone"}}
    alone = chat(client, **greedy).choices[0].message.content
    greedy["extra_body"]["cache_salt"] = "beside"  # (prefilled whole too: same arithmetic)
    neighbours = [
        {"frequency_penalty": 1.5, "presence_penalty": 1.0, "max_tokens": 64},
        {"logit_bias": {"13": 5.0}, "temperature": 0.8, "seed": 1, "max_tokens": 64},
        {"response_format": {"type": "json_object"}, "max_tokens": 64},
    ]
    with ThreadPoolExecutor(len(neighbours) + 1) as pool:
        running = [pool.submit(chat, client, **n) for n in neighbours]
        time.sleep(0.5)
        beside = pool.submit(chat, client, **greedy)
        assert beside.result().choices[0].message.content == alone
        assert all(r.result().choices[0].message.content is not None for r in running)


def test_logprobs_through_every_door(client, server):
    """Chat (whole and streamed), completions, n=2, and Triton's generate endpoint with
    TensorRT-LLM's return_log_probs: the tokens' logprobs spell the reply, greedy tokens are
    their own top alternative, and every door gives the same numbers for the same reply."""
    whole = chat(client, logprobs=True, top_logprobs=3, max_tokens=8)
    c = whole.choices[0]
    content = c.logprobs.content
    assert "".join(t.token for t in content) == c.message.content
    assert whole.usage.completion_tokens - len(content) in (0, 1)  # (EOS has none)
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob) and t.logprob <= 0
        assert bytes(t.bytes).decode() == t.token
    stream = chat(client, logprobs=True, top_logprobs=3, max_tokens=8, stream=True)
    streamed = [t for ch in stream if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]  # fmt: skip
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    plain = chat(client, max_tokens=8)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == c.message.content  # asking changes no token

    completion = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=6, logprobs=2
    )
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
    pairs = zip(lp.tokens, lp.top_logprobs, strict=True)
    assert all(len(alts) <= 2 and tok in alts for tok, alts in pairs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    two = chat(client, logprobs=True, max_tokens=8, n=2, temperature=1.0, seed=3)
    assert all(ch.logprobs.content and not ch.logprobs.content[0].top_logprobs
               for ch in two.choices)  # fmt: skip

    body = {
        "text_input": ASK[0]["content"], "apply_chat_template": True, "max_tokens": 8,
        "exclude_input_in_output": True, "return_log_probs": True,
    }  # fmt: skip
    for model in ("ensemble", "router"):
        url = f"http://127.0.0.1:{server.settings.http_port}/v2/models/{model}/generate"
        req = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["text_output"] == c.message.content
        values = out["output_log_probs"]
        assert values == pytest.approx([t.logprob for t in content], abs=1e-4), model


def test_bad_logprobs_fields_get_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, top_logprobs=2)  # without logprobs
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=21)
    assert e.value.body["param"] == "logprobs"
