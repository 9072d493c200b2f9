"""Gateway logic without a server: request parsing, keys, per-key limits, the registry."""

from __future__ import annotations

import json
import random

import pytest

from disagg import contracts as C
from disagg.codec.fields import GenerationFields
from disagg.errors import ConfigError
from disagg.gateway.auth import KeyStore, RateLimiter, key_hash, new_key, write_keys_file
from disagg.gateway.errors import APIError
from disagg.gateway.openai_api import parse_request
from disagg.gateway.registry import Registry

pytestmark = pytest.mark.unit
MSG = [{"role": "user", "content": "hi"}]


def test_chat_request_maps_to_router_inputs():
    req = parse_request(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": "END",
            "stream": True,
            "stream_options": {"include_usage": True},
            "latency_sla_ms": 150,
            "ignore_eos": True,
            "user": "ignored",
        },
        "chat",
    )
    assert json.loads(req.inputs["messages"]) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert req.inputs["max_tokens"] == 7 and req.inputs["stop_words"] == ["END"]
    assert req.inputs["latency_sla_ms"] == 150.0 and req.inputs["seed"] == 3
    assert req.stream and req.include_usage and req.inputs["ignore_eos"] is True


@pytest.mark.parametrize(
    "body, param",
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"tools": [{}]}, "tools"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "a lot"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": []}}, "response_format"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"yaml": "a"}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "x" * 70000}, "guided_regex"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
    ],
)
def test_unsupported_or_invalid_fields_are_refused_by_name(body, param):
    with pytest.raises(APIError) as e:
        parse_request({"model": "m", "messages": MSG, **body}, "chat")
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_sampling_controls_map_to_router_inputs(kind):
    prompt = {"messages": MSG} if kind == "chat" else {"prompt": "p"}
    body = {
        "model": "m",
        **prompt,
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.2,
        "logit_bias": {"42": -100, "7": 2.5},
        "min_tokens": 3,
        "stop_token_ids": [5, 6],
        "max_tokens": 9,
        "max_completion_tokens": 9,  # both: they agree
    }
    inputs = parse_request(body, kind).inputs
    assert (inputs["presence_penalty"], inputs["frequency_penalty"]) == (0.5, -1.0)
    assert inputs["repetition_penalty"] == 1.2 and inputs["min_length"] == 3
    assert json.loads(inputs["logit_bias"]) == {"42": -100.0, "7": 2.5}
    assert inputs["stop_token_ids"] == [5, 6] and inputs["max_tokens"] == 9
    fields = GenerationFields.parse(inputs)  # as the orchestrator reads the tensors
    assert fields.logit_bias == ((42, -100.0), (7, 2.5)) and fields.min_length == 3


def test_completion_specific_refusals():
    for body in ({"echo": True}, {"best_of": 2}, {"suffix": "x"}, {"prompt": ["a", "b"]}):
        with pytest.raises(APIError):
            parse_request({"model": "m", "prompt": "p", **body}, "completion")
    req = parse_request({"model": "m", "prompt": ["only one"]}, "completion")
    assert req.inputs["text_input"] == "only one" and "messages" not in req.inputs


def test_keys_are_kept_as_hashes_and_checked(tmp_path):
    key = new_key()
    path = tmp_path / "keys"
    write_keys_file(path, [key_hash(key)])
    assert key not in path.read_text() and oct(path.stat().st_mode)[-3:] == "600"
    store = KeyStore.load("sk-env-1, sk-env-2", path)
    assert store.key_id(f"Bearer {key}") == key_hash(key)[:12]
    assert store.key_id("Bearer sk-env-2") is not None
    assert store.key_id("Bearer nope") is None and store.key_id(None) is None
    assert store.key_id(key) is None  # not a Bearer header
    path.write_text("sha256:short\n")
    with pytest.raises(ConfigError, match="keys:1"):
        KeyStore.load(None, path)


def test_per_key_limits_slide_over_a_minute():
    t = [0.0]
    lim = RateLimiter(rpm=2, tpm=100, clock=lambda: t[0])
    assert lim.admit("a") is None and lim.admit("a") is None
    assert lim.admit("a") == pytest.approx(60.0)
    assert lim.admit("b") is None  # per key
    t[0] = 30.0
    assert lim.admit("a") == pytest.approx(30.0)
    t[0] = 60.0
    assert lim.admit("a") is None
    lim.charge("b", 100)
    assert lim.admit("b") == pytest.approx(60.0)  # token budget spent


REGISTRY = """
[models.m]
versions = [
  { name = "v1", triton_model = "router", state = "stable" },
  { name = "v2", triton_model = "r2", triton_version = "2", state = "canary", weight = 0.25 },
  { name = "v0", triton_model = "router", state = "deprecated" },
]
[models.old]
deprecated = "m"
"""


def test_registry_splits_traffic_by_weight_and_pins_versions(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(REGISTRY)
    reg = Registry(path, rng=random.Random(0))
    picks = [reg.resolve("m")[1].name for _ in range(4000)]
    assert 0.22 < picks.count("v2") / 4000 < 0.28
    v = reg.resolve("m:v2")[1]
    assert (v.triton_model, v.triton_version) == ("r2", "2")
    for name, status in (("old", 410), ("m:v0", 410), ("nope", 404), ("m:v9", 404)):
        with pytest.raises(APIError) as e:
            reg.resolve(name)
        assert e.value.status == status
    assert reg.rollback("m") == ["v2"]
    assert {reg.resolve("m")[1].name for _ in range(200)} == {"v1"}
    with pytest.raises(APIError, match="more than 1"):
        reg.update("m", "v2", "canary", 0.9)
        reg.update("m", "v0", "canary", 0.5)
    assert [m.name for m in reg.listed()] == ["m"]


@pytest.mark.parametrize(
    "text, message",
    [
        ('[models.m]\nversions = [{ name = "v1", state = "canary", weight = 0.5 }]', "stable"),
        ('[models.m]\nversions = [{ name = "v1", state = "live" }]', "state must be"),
        ('[models.m]\nversions = [{ name = "v1", colour = "red" }]', "unknown keys"),
        ('[models.m]\ntool_format = "llama9"\nversions = [{ name = "v1" }]', "tool_format"),
        ('[models.m]\ntool_parser = "hermes"\nversions = [{ name = "v1" }]', "unknown keys"),
        ("", "no models"),
    ],
)
def test_a_bad_registry_is_refused(tmp_path, text, message):
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        Registry(path)


def test_keys_from_a_secret_file_join_the_environments(tmp_path):
    from disagg.gateway.__main__ import _env_keys

    secret = tmp_path / "disagg_api_keys"
    secret.write_text("sk-one\nsk-two, sk-three\n")
    store = KeyStore.load(
        _env_keys({"DISAGG_API_KEYS": "sk-env", "DISAGG_API_KEYS_FILE": str(secret)}), None
    )  # noqa: E501
    for key in ("sk-env", "sk-one", "sk-two", "sk-three"):
        assert store.key_id(f"Bearer {key}") is not None
    with pytest.raises(ConfigError, match="DISAGG_API_KEYS_FILE"):
        _env_keys({"DISAGG_API_KEYS_FILE": str(tmp_path / "missing")})


def test_logprobs_fields_become_tensorrt_llm_inputs_and_openai_shapes():
    from disagg.gateway.openai_api import choice_logprobs

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat = parse_request({**body, "logprobs": True, "top_logprobs": 3}, "chat")
    assert chat.logprobs and chat.inputs[C.RETURN_LOG_PROBS] is True
    assert chat.inputs[C.TOP_LOGPROBS] == 3
    assert C.RETURN_LOG_PROBS not in parse_request(body, "chat").inputs
    comp = parse_request({"model": "m", "prompt": "hi", "logprobs": 0}, "completion")
    assert comp.logprobs and C.TOP_LOGPROBS not in comp.inputs  # the token's own only
    content = [
        {"token": "Hel", "logprob": -0.1, "bytes": [], "top_logprobs": [
            {"token": "Hel", "logprob": -0.1, "bytes": []}]},
        {"token": "lo", "logprob": -0.2, "bytes": [], "top_logprobs": []},
    ]  # fmt: skip
    shaped = choice_logprobs(comp, content, offset=4)
    assert shaped["tokens"] == ["Hel", "lo"] and shaped["text_offset"] == [4, 7]
    assert shaped["top_logprobs"] == [{"Hel": -0.1}, {}]
    assert choice_logprobs(chat, content) == {"content": content, "refusal": None}


def test_more_choices_than_decode_runs_at_once_are_refused_by_name():
    body = {"model": "m", "messages": MSG, "n": 5}
    assert parse_request(body, "chat", max_n=5).n == 5
    with pytest.raises(APIError) as e:
        parse_request(body, "chat", max_n=4)
    assert e.value.status == 400 and e.value.param == "n" and "4 sequences" in e.value.message


def test_each_model_writes_tools_in_the_format_the_registry_names(tmp_path, monkeypatch):
    from disagg.gateway import tools

    class Angle:  # a made-up format: calls inside <<call>> ... <</call>>, read back whole
        name, OPEN, CLOSE, HEAD = "angle", "<<call>>", "<</call>>", None

        def system_text(self, t):
            return "Tools: " + ", ".join(sorted(t.names))

        def call_text(self, name, arguments):
            return self.OPEN + json.dumps({"name": name, "arguments": arguments}) + self.CLOSE

        def tool_result_text(self, content):
            return "[result] " + content

        def grammar(self, t):
            return "start: /x/"

    monkeypatch.setitem(tools.FORMATS, "angle", Angle())
    path = tmp_path / "models.toml"
    path.write_text('[models.a]\ntool_format = "angle"\nversions = [{ name = "v1" }]\n'
                    '[models.h]\nversions = [{ name = "v1" }]\n')  # fmt: skip
    reg = Registry(path)
    assert reg.tool_format("a:v1").name == "angle" and reg.tool_format("h").name == "hermes"
    weather = {"type": "function", "function": {"name": "get_weather"}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    body = {"model": "a", "tools": [weather], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]}  # fmt: skip
    req = parse_request(body, "chat", tool_format=reg.tool_format("a"))
    rendered = json.loads(req.inputs[C.MESSAGES])
    assert rendered[0]["content"] == "Tools: get_weather"
    assert rendered[2]["content"] == '<<call>>{"name": "get_weather", "arguments": {}}<</call>>'
    assert rendered[3] == {"role": "user", "content": "[result] sunny"}
    reply = '<<call>>{"name": "get_weather", "arguments": {"city": "Oslo"}}<</call>>'
    content, calls = tools.parse_reply(reply, req.tools)
    assert content is None and calls[0].arguments == '{"city": "Oslo"}'
    from disagg.gateway.tool_stream import ToolStream

    stream = ToolStream(req.tools)
    deltas = [d for ch in reply for d in stream.feed(ch)[1]]  # (no HEAD: each call whole)
    assert [d["function"].get("name") for d in deltas] == ["get_weather", None]
