"""Structured outputs without a model: the gateway's mapping of OpenAI's and vLLM's fields to
the guided-decoding inputs, the request checks, how sampling applies a guide's mask (a
stand-in Guide with a fixed mask: the real one is tests/model/test_guided_decoding.py's), and
the router's rule for the external endpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from disagg import contracts as C
from disagg.codec.fields import GenerationFields
from disagg.engine.sampling import sample_batch, sample_one
from disagg.engine.sequence import SamplingParams
from disagg.errors import RequestError
from disagg.gateway.openai_api import parse_request
from disagg.routing.request import local_only_fields, response_format

pytestmark = pytest.mark.unit
MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def guided(body: dict, kind: str = "chat") -> tuple[str, str]:
    prompt = {"messages": MSG} if kind == "chat" else {"prompt": "p"}
    inputs = parse_request({"model": "m", **prompt, **body}, kind).inputs
    g = GenerationFields.parse(inputs)  # as the orchestrator reads the tensors
    return g.guide_type, g.guide


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_openai_and_vllm_fields_map_to_one_guide(kind):
    schema_fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert guided({"response_format": schema_fmt}, kind) == ("json_schema", json.dumps(SCHEMA))
    assert guided({"response_format": {"type": "json_object"}}, kind) == ("json", "")
    assert guided({"response_format": {"type": "text"}}, kind) == ("", "")
    assert guided({"structured_outputs": {"regex": "[ab]+"}}, kind) == ("regex", "[ab]+")
    assert guided({"guided_grammar": 'root ::= "x"'}, kind) == ("ebnf_grammar", 'root ::= "x"')
    assert guided({"guided_json": json.dumps(SCHEMA)}, kind)[0] == "json_schema"
    assert guided({"structured_outputs": {"json_object": True}}, kind) == ("json", "")
    kind_, lark = guided({"guided_choice": ["yes", 'no "way"']}, kind)
    assert kind_ == "lark" and lark == 'start: "yes" | "no \\"way\\""'


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "response_format",
        ),  # fmt: skip
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
        ({"guided_regex": "a{3,1}"}, "guided_regex"),
        ({"guided_json": {"properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json"),
        ({"guided_grammar": "root ::= foo"}, "guided_grammar"),  # (foo: no such rule)
    ],
)
def test_a_guide_that_does_not_compile_is_a_400_naming_its_field(body, param):
    from disagg.gateway.errors import APIError

    with pytest.raises(APIError) as e:
        guided(body)
    assert e.value.status == 400 and e.value.param == param
    assert "does not" in e.value.message  # (the library's reason follows)


def test_request_checks_name_what_is_wrong():
    for params, words in (
        (SamplingParams(guide_type="yaml", guide="a"), "guided_decoding_guide_type"),
        (SamplingParams(guide_type="regex"), "required"),
        (SamplingParams(guide="a"), "needs guided_decoding_guide_type"),
        (SamplingParams(guide_type="regex", guide="x" * 70000), "at most"),
        (SamplingParams(guide_type="json", guide_tokens=(10**9,)), "guide_tokens"),
    ):
        with pytest.raises(RequestError, match=words):
            params.validate(1000, 64)
    SamplingParams(guide_type="json").validate(1000, 64)


class FixedGuide:
    """A stand-in for engine/grammar.Guide: allows a fixed set of tokens, records what it saw."""

    def __init__(self, allowed: set[int] | None) -> None:
        self.allowed_ids, self.seen = allowed, []
        self.dead = False

    def allowed(self, tokens, vocab_size):
        self.seen.append(list(tokens))
        if not self.allowed_ids:
            self.dead = True
            return None
        mask = np.zeros(vocab_size, dtype=bool)
        mask[list(self.allowed_ids)] = True
        return mask


def test_only_allowed_tokens_are_drawn_greedy_and_sampled():
    lg = torch.randn(50, generator=torch.Generator().manual_seed(0))
    allowed = {3, 17, 41}
    assert sample_one(lg, SamplingParams(), 0, [], guide=FixedGuide(allowed)) == max(
        allowed, key=lambda t: float(lg[t])
    )
    hot = SamplingParams(temperature=2.0)
    drawn = {sample_one(lg, hot, s, [1, 2], guide=FixedGuide(allowed)) for s in range(60)}
    assert drawn <= allowed and len(drawn) > 1


def test_the_guide_sees_migrated_tokens_then_output():
    g = FixedGuide({5})
    sample_one(torch.zeros(10), SamplingParams(guide_tokens=(7, 8)), 0, [9], guide=g)
    assert g.seen == [[7, 8, 9]]


def test_a_dead_end_returns_eos_and_marks_the_guide():
    g = FixedGuide(set())
    assert sample_one(torch.randn(10), SamplingParams(), 0, [], (), {2}, g) == 2
    assert g.dead


def test_min_tokens_never_masks_everything_the_grammar_allows():
    # the grammar allows only EOS (2); min_tokens would mask it: the grammar wins
    p = SamplingParams(min_tokens=5)
    assert sample_one(torch.randn(10), p, 0, [], (), {2}, FixedGuide({2})) == 2


def test_a_guided_neighbour_never_moves_a_greedy_row():
    lg = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(), SamplingParams()]
    alone = sample_batch(lg, params, [0, 0, 0], [[], [], []])
    mixed = sample_batch(lg, params, [0, 0, 0], [[], [], []], guides=[None, FixedGuide({4}), None])
    assert mixed[0] == alone[0] and mixed[2] == alone[2] and mixed[1] == 4


def test_json_guides_may_go_to_the_endpoint_grammars_stay_local():
    def fields(guide_type: str, guide: str) -> dict:
        return {
            C.TEXT_INPUT: "x",
            C.GUIDED_DECODING_GUIDE_TYPE: guide_type,
            C.GUIDED_DECODING_GUIDE: guide,
        }

    assert local_only_fields(fields("json_schema", json.dumps(SCHEMA)), MSG) == ()
    assert local_only_fields(fields("json", ""), MSG) == ()
    assert C.GUIDED_DECODING_GUIDE_TYPE in local_only_fields(fields("regex", "a+"), MSG)
    g = GenerationFields.parse(fields("json_schema", json.dumps(SCHEMA)))
    assert response_format(g) == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": SCHEMA, "strict": True},
    }
    assert response_format(GenerationFields.parse(fields("json", ""))) == {"type": "json_object"}


def test_logprobs_stay_local_tool_grammars_may_go_to_the_endpoint():
    base = {C.TEXT_INPUT: "x"}
    assert local_only_fields(base, MSG) == ()
    assert C.RETURN_LOG_PROBS in local_only_fields({**base, C.RETURN_LOG_PROBS: True}, MSG)
    call = {**base, C.GUIDED_DECODING_GUIDE_TYPE: "lark", C.GUIDED_DECODING_GUIDE: 'start: "x"'}
    assert C.GUIDED_DECODING_GUIDE_TYPE in local_only_fields(call, MSG)  # a grammar of its own
    tools = json.dumps({"messages": MSG, "tools": []})  # the client's tools: the endpoint's
    assert local_only_fields({**call, C.OPENAI_TOOLS: tools}, MSG) == ()  # tool_choice does it
