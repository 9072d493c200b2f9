"""Guided decoding on the real model (engine/grammar.py with llguidance): replies match their
guide, and one guide gives one reply co-located, disaggregated (prefill samples the first
token under the grammar, decode rebuilds the grammar state from the tokens) and after a
migration (the continued request's prompt ends with the tokens sent; guide_tokens hands the
grammar what it had consumed)."""

import json
import re

import pytest

from disagg.engine.sequence import FinishReason, SamplingParams
from disagg.errors import RequestError

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ASK = "What's the weather going to be in Paris this week? Answer as JSON."


def chat_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    )


def run(decode, rid, params, **kw) -> tuple[list[int], str | None]:
    decode.add_request(rid, params, **kw)
    out, reason = [], None
    while decode.has_unfinished:
        for o in decode.step():
            if o.token_id is not None:
                out.append(o.token_id)
            reason = o.finish_reason or reason
    return out, reason


def test_a_schema_reply_parses_and_validates(llm, engines):
    params = SamplingParams(max_tokens=60, guide_type="json_schema", guide=json.dumps(SCHEMA))
    tokens, reason = run(engines[1], "s", params, prompt_ids=chat_ids(llm, ASK))
    reply = json.loads(llm.tokenizer.decode(tokens))
    assert reason == FinishReason.STOP
    assert set(reply) == {"city", "unit", "days"} and reply["unit"] in ("celsius", "fahrenheit")
    assert isinstance(reply["days"], int) and 1 <= reply["days"] <= 14


@pytest.mark.parametrize(
    "guide_type,guide,check",
    [
        ("json", "", lambda t: isinstance(json.loads(t), dict)),
        ("regex", r"(yes|no)\. [A-Z][a-z ]{3,30}\.", None),
        ("ebnf_grammar", 'root ::= "Answer: " [0-9]{1,3} "."', None),
        ("lark", 'start: "red" | "green" | "blue"', lambda t: t in ("red", "green", "blue")),
    ],
)
def test_every_guide_type_holds_and_disaggregated_equals_colocated(
    llm, engines, guide_type, guide, check
):
    prefill, decode = engines
    ids = chat_ids(llm, "Is the sky blue? Explain briefly.")
    params = SamplingParams(max_tokens=40, guide_type=guide_type, guide=guide)
    colocated, _ = run(decode, "c", params, prompt_ids=ids)
    first = prefill.prefill("d", ids, params)
    rest, _ = run(decode, "d", params, prefill=first, prompt_ids=ids)
    assert [first.first_token, *rest] == colocated
    text = llm.tokenizer.decode(colocated)
    if guide_type in ("regex", "ebnf_grammar"):
        pattern = guide if guide_type == "regex" else r"Answer: [0-9]{1,3}\."
        assert re.fullmatch(pattern, text), text
    else:
        assert check(text), text


def test_a_migrated_stream_continues_the_same_reply(llm, engines):
    """What orchestrator._continue_from_tokens asks for: the prompt plus the tokens sent as
    the new prompt, the grammar told it consumed them."""
    decode = engines[1]
    ids = chat_ids(llm, ASK)
    params = SamplingParams(max_tokens=60, guide_type="json_schema", guide=json.dumps(SCHEMA))
    whole, _ = run(decode, "w", params, prompt_ids=ids)
    k = 7
    cont = SamplingParams(
        max_tokens=60 - k, guide_type="json_schema", guide=json.dumps(SCHEMA),
        guide_tokens=tuple(whole[:k]),
    )  # fmt: skip
    rest, _ = run(decode, "m", cont, prompt_ids=ids + whole[:k])
    assert whole[:k] + rest == whole


def test_a_complete_grammar_stops_even_with_ignore_eos(llm, engines):
    params = SamplingParams(max_tokens=30, ignore_eos=True, guide_type="lark", guide='start: "ok"')
    tokens, reason = run(engines[1], "e", params, prompt_ids=chat_ids(llm, "Say ok."))
    assert llm.tokenizer.decode(tokens) == "ok" and reason == FinishReason.STOP


@pytest.mark.parametrize(
    "guide_type,guide,words",
    [
        ("json_schema", "{not json", "does not parse"),
        ("regex", "(unclosed", "does not compile"),
        ("ebnf_grammar", "root ::= missing", "does not parse"),
        ("json_schema", json.dumps({"properties": {"a": {"$ref": "#/nowhere"}}}), "compile"),
    ],
)
def test_a_guide_that_does_not_compile_is_a_request_error(llm, engines, guide_type, guide, words):
    params = SamplingParams(max_tokens=4, guide_type=guide_type, guide=guide)
    prefill, decode = engines
    with pytest.raises(RequestError, match=words):
        prefill.prefill("x", chat_ids(llm, "hi"), params)
    with pytest.raises(RequestError, match=words):
        decode.add_request("x", params, prompt_ids=chat_ids(llm, "hi"))
    assert not decode.has_unfinished


def test_a_grammar_that_reaches_a_dead_end_ends_the_request_with_grammar_error(
    llm, engines, monkeypatch
):
    """llguidance's own grammars end rather than dead-end (a lexeme's token limit allows EOS),
    so the dead end is forced: the real guide allows nothing from the fourth token on. The
    request ends with grammar_error after the tokens the grammar allowed and EOS, and a
    neighbour decoding beside it is untouched."""
    from disagg.engine.grammar import Guide

    allowed = Guide.allowed

    def until_three(self, tokens, vocab_size):
        return None if len(tokens) >= 3 else allowed(self, tokens, vocab_size)

    decode = engines[1]
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    alone, _ = run(decode, "alone", plain, prompt_ids=chat_ids(llm, "Say hi."))
    monkeypatch.setattr(Guide, "allowed", until_three)
    params = SamplingParams(max_tokens=40, guide_type="json")
    decode.add_request("dead", params, prompt_ids=chat_ids(llm, ASK))
    decode.add_request("beside", plain, prompt_ids=chat_ids(llm, "Say hi."))
    got: dict[str, list[int]] = {"dead": [], "beside": []}
    reasons = {}
    while decode.has_unfinished:
        for o in decode.step():
            if o.token_id is not None:
                got[o.request_id].append(o.token_id)
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    # three allowed tokens, then the end-of-sequence token (no text), never a refused one
    assert reasons["dead"] == FinishReason.GRAMMAR and len(got["dead"]) == 4
    assert got["dead"][3] == llm.tokenizer.eos_token_id
    assert llm.tokenizer.decode(got["dead"][:3]).startswith("{")  # what the grammar allowed
    assert got["beside"] == alone and reasons["beside"] == FinishReason.LENGTH
