"""Logprobs on the real model: the emitted token's and the top alternatives' come from the
model's raw distribution, prefill's first token and decode's later ones agree with a
co-located run, and a neighbour asking for logprobs changes no other row's tokens."""

import math

import pytest

from disagg.engine.sequence import SamplingParams

pytestmark = pytest.mark.model

ASK = "Name three colours of the rainbow."


def chat_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    )


def run(decode, requests):
    """requests: (rid, params, kwargs); -> rid -> [(token, TokenLogprob | None)]."""
    for rid, params, kw in requests:
        decode.add_request(rid, params, **kw)
    out = {rid: [] for rid, _, _ in requests}
    while decode.has_unfinished:
        for o in decode.step():
            if o.token_id is not None:
                out[o.request_id].append((o.token_id, o.logprob))
    return out


def test_greedy_tokens_are_their_rows_top_alternative_and_probabilities_are_proper(llm, engines):
    params = SamplingParams(max_tokens=12, logprobs=5, ignore_eos=True)
    got = run(engines[1], [("g", params, {"prompt_ids": chat_ids(llm, ASK)})])["g"]
    assert len(got) == 12
    for token, lp in got:
        assert lp is not None and len(lp.top) == 5
        assert lp.top[0][0] == token  # greedy: the most likely token is the one emitted
        assert lp.logprob == pytest.approx(lp.top[0][1])
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5


def test_disaggregated_logprobs_equal_colocated(llm, engines):
    prefill, decode = engines
    ids = chat_ids(llm, ASK)
    params = SamplingParams(max_tokens=8, logprobs=2, ignore_eos=True)
    colocated = run(decode, [("c", params, {"prompt_ids": ids})])["c"]
    first = prefill.prefill("d", ids, params)
    assert first.first_logprob is not None
    rest = run(decode, [("d", params, {"prefill": first})])["d"]
    disaggregated = [(first.first_token, first.first_logprob), *rest]
    assert [t for t, _ in disaggregated] == [t for t, _ in colocated]
    for (_, a), (_, b) in zip(disaggregated, colocated, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_neighbour_asking_for_logprobs_leaves_a_greedy_row_unchanged(llm, engines):
    decode = engines[1]
    ids = chat_ids(llm, ASK)
    plain = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = run(decode, [("a", plain, {"prompt_ids": ids})])["a"]
    other = SamplingParams(max_tokens=10, logprobs=20, temperature=0.8, seed=7)
    both = run(
        decode,
        [("b", plain, {"prompt_ids": ids}), ("n", other, {"prompt_ids": chat_ids(llm, "Hi")})],
    )
    assert [t for t, _ in both["b"]] == [t for t, _ in alone]
    assert all(lp is None for _, lp in both["b"])  # not asked: nothing computed
    assert all(lp is not None and len(lp.top) == 20 for _, lp in both["n"])
