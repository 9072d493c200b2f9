"""Sampling controls on the real model: penalties make a greedy reply repeat less, and every
control gives the same reply disaggregated (prefill samples the first token) as co-located."""

import pytest

from disagg.engine.sequence import SamplingParams

pytestmark = pytest.mark.model

REPETITIVE = "Write a long story about a cat."  # greedy: 9 repeated tokens in 40
SHORT = "What is the capital of France? Answer with one word."


def colocated(engines, prompt_ids, params) -> list[int]:
    _, decode = engines
    decode.add_request("c", params, prompt_ids=prompt_ids)
    return _drain(decode)


def disaggregated(engines, prompt_ids, params) -> list[int]:
    prefill, decode = engines
    first = prefill.prefill("d", prompt_ids, params)
    decode.add_request("d", params, prefill=first, prompt_ids=prompt_ids)
    return [first.first_token, *_drain(decode)]


def _drain(engine) -> list[int]:
    out = []
    while engine.has_unfinished:
        out += [o.token_id for o in engine.step() if o.token_id is not None]
    return out


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_frequency_penalty_repeats_less_and_both_modes_agree(llm, engines):
    ids = llm.encode(REPETITIVE)
    plain = colocated(engines, ids, SamplingParams(max_tokens=40))
    params = SamplingParams(max_tokens=40, frequency_penalty=1.5)
    penalised = colocated(engines, ids, params)
    assert repeats(penalised) < repeats(plain), (plain, penalised)
    assert disaggregated(engines, ids, params) == penalised


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, presence_penalty=1.0),
        SamplingParams(max_tokens=24, repetition_penalty=1.5),  # counts the prompt too
        SamplingParams(max_tokens=24, temperature=0.8, seed=5, frequency_penalty=0.7),
    ],
    ids=["presence", "repetition", "sampled"],
)
def test_disaggregated_equals_colocated_with_penalties(llm, engines, params):
    ids = llm.encode(REPETITIVE)
    assert disaggregated(engines, ids, params) == colocated(engines, ids, params)


def test_min_tokens_and_logit_bias_hold_in_both_modes(llm, engines):
    ids, eos = llm.encode(SHORT), llm.tokenizer.eos_token_id
    short = colocated(engines, ids, SamplingParams(max_tokens=32))
    assert short[-1] == eos and len(short) < 10  # the plain reply ends early
    longer = SamplingParams(max_tokens=32, min_tokens=len(short) + 4)
    reply = colocated(engines, ids, longer)
    assert eos not in reply[: longer.min_tokens] and len(reply) > longer.min_tokens
    assert disaggregated(engines, ids, longer) == reply
    banned = SamplingParams(max_tokens=16, logit_bias=((short[0], -100.0),))
    other = colocated(engines, ids, banned)
    assert short[0] not in other and disaggregated(engines, ids, banned) == other


def test_a_greedy_neighbour_keeps_its_reply_next_to_penalties(llm, engines):
    ids = llm.encode(REPETITIVE)
    greedy = SamplingParams(max_tokens=24)
    alone = colocated(engines, ids, greedy)
    engine = engines[1]
    engine.add_request("g", greedy, prompt_ids=ids)
    engine.add_request("p", SamplingParams(max_tokens=24, frequency_penalty=2.0), prompt_ids=ids)
    got: dict[str, list[int]] = {"g": [], "p": []}
    while engine.has_unfinished:
        for o in engine.step():
            if o.token_id is not None:
                got[o.request_id].append(o.token_id)
    assert got["g"] == alone and got["p"] != alone
