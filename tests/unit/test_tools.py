"""Tool calls without a model: the gateway's checks of tools / tool_choice, the Hermes
rendering of tools and of a conversation's calls and results, the grammar a required call
is decoded under, and parsing replies whole and streamed."""

from __future__ import annotations

import json

import pytest

from disagg import contracts as C
from disagg.gateway.errors import APIError
from disagg.gateway.openai_api import full_response, parse_request
from disagg.gateway.tool_stream import ToolStream
from disagg.gateway.tools import Hermes, parse_reply, parse_tools

pytestmark = pytest.mark.unit
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
MSG = [{"role": "user", "content": "Weather in Paris?"}]


def request(**body):
    return parse_request({"model": "m", "messages": MSG, "tools": [WEATHER, TIME], **body}, "chat")


def test_tools_are_described_in_the_system_message_hermes_style():
    req = request()
    messages = json.loads(req.inputs[C.MESSAGES])
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert (
        json.dumps({"type": "function", "function": req.tools.functions[0]})
        in (messages[0]["content"])
    )
    assert messages[1] == MSG[0] and req.inputs[C.TASK_TYPE] == "tool_call"
    assert C.GUIDED_DECODING_GUIDE_TYPE not in req.inputs  # auto: the model is free


def test_a_conversation_with_calls_and_results_renders_as_text():
    history = [
        {"role": "system", "content": "Be brief."},
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    req = parse_request({"model": "m", "messages": history, "tools": [WEATHER]}, "chat")
    m = json.loads(req.inputs[C.MESSAGES])
    assert m[0]["content"].startswith("Be brief.\n\n# Tools")
    assert m[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
    }
    assert m[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}


def test_required_and_named_choices_decode_under_a_grammar():
    req = request(tool_choice="required")
    assert req.inputs[C.GUIDED_DECODING_GUIDE_TYPE] == "lark"
    grammar = req.inputs[C.GUIDED_DECODING_GUIDE]
    assert grammar.startswith('start: call ("\\n" call)*') and "get_time" in grammar
    named = request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "get_weather" not in named.inputs[C.GUIDED_DECODING_GUIDE]
    single = request(tool_choice="required", parallel_tool_calls=False)
    assert single.inputs[C.GUIDED_DECODING_GUIDE].startswith("start: ")
    none = request(tool_choice="none")
    assert none.tools is None and "<tools>" not in none.inputs[C.MESSAGES]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (  # a schema no grammar can be made of, refused even under tool_choice auto
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "wat"}}},
                        },
                    }
                ]
            },
            "tools",
        ),  # fmt: skip
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tools_are_refused_by_name(body, param):
    with pytest.raises(APIError) as e:
        request(**body)
    assert e.value.status == 400 and e.value.param == param
    with pytest.raises(APIError):  # tool_choice without tools
        parse_request({"model": "m", "messages": MSG, "tool_choice": "required"}, "chat")


def test_tool_schemas_are_checked_strictly_only_where_a_call_must_come():
    """A keyword llguidance does not implement passes under auto (no grammar is built from
    it), and is a 400 naming `tools` when the call is required (its grammar would be)."""
    unique = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": unique}}
    assert request(tools=[tool]).tools is not None
    with pytest.raises(APIError) as e:
        request(tools=[tool], tool_choice="required")
    assert e.value.status == 400 and e.value.param == "tools" and "uniqueItems" in e.value.message
    huge = {"type": "object", "description": "x" * 70000}
    with pytest.raises(APIError, match="characters"):
        request(tools=[{"type": "function", "function": {"name": "g", "parameters": huge}}])


def test_a_reply_with_calls_becomes_tool_calls():
    tools = parse_tools({"tools": [WEATHER, TIME]})
    text = (
        "Let me check.\n" + Hermes.call_text("get_weather", {"city": "Paris"}) + "\n"
        + Hermes.call_text("get_time", {})
    )  # fmt: skip
    content, calls = parse_reply(text, tools)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    body = full_response(request(), "r", text, "stop", 5, 9, "fp")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_call_that_does_not_parse_stays_text():
    tools = parse_tools({"tools": [WEATHER]})
    for text in (
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
        "<tool_call>\n" + '{"name": "get_weather", "arguments": {"city": "Pa',  # cut by length
    ):
        assert parse_reply(text, tools) == (text, [])


def test_a_streamed_reply_splits_into_content_and_call_deltas_in_any_pieces():
    tools = parse_tools({"tools": [WEATHER, TIME]})
    text = "Sure. " + Hermes.call_text("get_weather", {"city": "Paris"})
    for size in (1, 3, 7, len(text)):
        stream = ToolStream(tools)
        content, deltas = "", []
        for i in range(0, len(text), size):
            c, d = stream.feed(text[i : i + size])
            content, deltas = content + c, deltas + d
        content += stream.finish()
        assert content == "Sure. "
        assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
        assert deltas[0]["id"].startswith("call_") and deltas[0]["index"] == 0
        args = "".join(d["function"]["arguments"] for d in deltas)
        assert json.loads(args) == {"city": "Paris"}


def test_a_stream_without_a_call_passes_its_text_through_even_a_lone_angle_bracket():
    stream = ToolStream(parse_tools({"tools": [WEATHER]}))
    out = "".join(stream.feed(p)[0] for p in ("a <b", " and <tool", "_c"))
    assert out + stream.finish() == "a <b and <tool_c"


def test_arguments_stream_as_they_are_written_and_add_up_to_the_whole_replys():
    tools = parse_tools({"tools": [WEATHER, TIME]})
    args = {"city": "Paris", "unit": "celsius"}
    text = Hermes.call_text("get_weather", args) + Hermes.call_text("get_time", {})
    stream = ToolStream(tools)
    seen: list[tuple[int, dict]] = []  # (characters fed, delta)
    for n, ch in enumerate(text, 1):
        seen += [(n, d) for d in stream.feed(ch)[1]]
    assert stream.finish() == ""
    first_close = text.index(Hermes.CLOSE)
    head_at = next(n for n, d in seen if d["function"].get("name") == "get_weather")
    assert head_at <= text.index('"city"')  # the name went out before the arguments came
    pieces = [d for n, d in seen if d["index"] == 0 and d["function"]["arguments"]]
    assert len(pieces) > 3 and seen[1][0] < first_close  # arguments grew before the close
    _, calls = parse_reply(text, tools)
    for i, call in enumerate(calls):
        streamed = "".join(d["function"]["arguments"] for _, d in seen if d["index"] == i)
        assert streamed == call.arguments
    assert json.loads(calls[0].arguments) == args
    assert [d["id"] for _, d in seen if "id" in d] == [c.id for c in stream.calls]


def test_an_endpoints_relayed_calls_make_the_reply_whole_and_streamed():
    from disagg.gateway.backend import Piece
    from disagg.gateway.choice_stream import ChoiceStream
    from disagg.gateway.openai_api import parse_request, whole_choice

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    req = parse_request(body, "chat")
    native = json.loads(req.inputs["openai_tools"])
    assert native["messages"] == body["messages"] and native["tools"] == [WEATHER]
    call = {"index": 0, "id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    choice = whole_choice(req, "", "tool_calls", relayed=[call])
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{k: v for k, v in call.items() if k != "index"}]
    stream = ChoiceStream(req, "r", "fp")
    chunks = stream.chunks(Piece("", 3, 1, None, tool_calls=[call]))
    chunks += stream.chunks(Piece("", 3, 2, "tool_calls"))
    assert chunks[0]["choices"][0]["delta"]["tool_calls"] == [call]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def feed_all(stream, text, size=1):
    content, deltas = "", []
    for i in range(0, len(text), size):
        c, d = stream.feed(text[i : i + size])
        content, deltas = content + c, deltas + d
    return content + stream.finish(), deltas


def test_a_close_tag_inside_a_json_string_does_not_end_the_block():
    tools = parse_tools({"tools": [WEATHER]})
    args = {"city": "say </tool_call> twice", "unit": "celsius"}
    text = Hermes.call_text("get_weather", args)
    content, calls = parse_reply(text, tools)
    assert content is None and json.loads(calls[0].arguments) == args
    content, deltas = feed_all(ToolStream(tools), text)
    assert content == "" and json.loads("".join(d["function"]["arguments"] for d in deltas)) == args


def test_a_call_cut_short_stays_one_call_and_nothing_is_sent_twice():
    tools = parse_tools({"tools": [WEATHER, TIME]})
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    stream = ToolStream(tools)
    content, deltas = feed_all(stream, cut)
    assert content == "" and len(stream.calls) == 1  # a call: finish_reason tool_calls
    assert deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Par'
    two = stream = ToolStream(tools)
    text = cut + '"}}\n</tool_call>\n' + Hermes.call_text("get_time", {})
    content, deltas = feed_all(two, text)
    assert [d["index"] for d in deltas if "id" in d] == [0, 1]  # the next call, next index


def test_argument_deltas_stop_where_the_arguments_value_ends():
    tools = parse_tools({"tools": [WEATHER]})
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": 3}</tool_call>'
    _, calls = parse_reply(text, tools)
    _, deltas = feed_all(ToolStream(tools), text)
    streamed = "".join(d["function"]["arguments"] for d in deltas)
    assert streamed == calls[0].arguments == '{"city": "Oslo"}'
