"""Prefix caching with the real model: a prompt that starts like earlier work prefills only
the rest, and greedy replies equal those with caching off, token for token."""

from __future__ import annotations

import dataclasses

import pytest

from disagg.engine.config import EngineConfig
from disagg.engine.llm_engine import DecodeEngine, PrefillEngine
from disagg.engine.sequence import SamplingParams

pytestmark = pytest.mark.model
SYSTEM = (
    "You are a harbour master's assistant. You know the tides, the berths, the pilots' "
    "rota and the rules for small craft. Answer in one or two sentences. "
) * 4
QUESTIONS = [
    "When is high tide today?",
    "Which berth takes a 90 metre ship?",
    "Who is the pilot on duty tonight?",
    "May a kayak cross the channel at dusk?",
]
PARAMS = SamplingParams(max_tokens=24)


def _prompts(llm) -> list[list[int]]:
    return [
        llm.tokenizer.encode_chat([{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": q}])
        for q in QUESTIONS
    ]  # fmt: skip


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _decode(llm, prompts, cache_tokens, concurrent, salts=None, chunk=64, first_alone=True):
    """Greedy replies, one after another, or (concurrent) the first alone and then the rest
    together, in chunks of `chunk` prompt tokens beside each other's decode steps (all
    together, a burst, without `first_alone`)."""
    config = EngineConfig(
        max_num_seqs=4, max_model_len=1024, prefix_cache_tokens=cache_tokens,
        prefill_chunk_tokens=chunk,
    )  # fmt: skip
    engine = DecodeEngine(llm.model, config, {llm.tokenizer.eos_token_id})
    out: dict[str, list[int]] = {}
    reused: dict[str, int] = {}

    def run() -> None:
        while engine.has_unfinished:
            for o in engine.step():
                if o.token_id is not None:
                    out.setdefault(o.request_id, []).append(o.token_id)
                if o.index == 0 and o.token_id is not None:
                    reused[o.request_id] = o.num_reused_tokens

    for i, p in enumerate(prompts):
        params = dataclasses.replace(PARAMS, cache_salt=salts[i] if salts else "")
        engine.add_request(f"r{i}", params, prompt_ids=p)
        if not concurrent or (i == 0 and first_alone):
            run()
    run()
    return (
        [out[f"r{i}"] for i in range(len(prompts))],
        [reused[f"r{i}"] for i in range(len(prompts))],
        engine,
    )


def test_decode_engine_reuses_a_shared_prefix_and_replies_as_without_cache(llm):
    prompts = _prompts(llm)
    off, reused_off, _ = _decode(llm, prompts, 0, concurrent=False)
    on, reused_on, engine = _decode(llm, prompts, 8192, concurrent=False)
    assert on == off
    assert reused_off == [0, 0, 0, 0]
    assert reused_on[0] == 0
    # every later prompt finds the full blocks (16 tokens) it shares with an earlier one
    for p, r in zip(prompts[1:], reused_on[1:], strict=True):
        shared = max(_common(p, q) for q in prompts[: prompts.index(p)])
        assert r == shared // 16 * 16 > 100, (shared, r)
    stats = engine.kv_reuse.index.stats
    assert stats.num_hit_tokens == sum(reused_on) and stats.num_stored_blocks > 0


def test_reuse_in_chunks_beside_running_sequences_replies_as_without_cache(llm):
    prompts = _prompts(llm)
    off, _, _ = _decode(llm, prompts, 0, concurrent=True, chunk=16)
    on, reused, _ = _decode(llm, prompts, 8192, concurrent=True, chunk=16)
    assert on == off and min(reused[1:]) > 100


def test_a_burst_sharing_a_prefix_computes_it_once(llm):
    """Arriving together, the prompts are prefilled one after another in the same step: the
    first one's blocks are kept as soon as its prompt is in, so the others find them."""
    prompts = _prompts(llm)
    off, _, _ = _decode(llm, prompts, 0, concurrent=True, first_alone=False)
    on, reused, _ = _decode(llm, prompts, 8192, concurrent=True, first_alone=False)
    assert on == off
    assert sorted(reused)[0] == 0 and sorted(reused)[1] > 100  # one computed it, for all


def test_a_burst_beside_a_running_sequence_computes_the_shared_prefix_once(llm):
    """Beside a decoding sequence (admitted whole in the same step), a burst's chunks run in
    one packed forward; a prompt whose first uncached block another chunk of that step
    computes waits a step and reuses it."""
    unrelated = llm.tokenizer.encode_chat([{"role": "user", "content": "Count to twenty."}])
    prompts = [unrelated, *_prompts(llm)]
    off, _, _ = _decode(llm, prompts, 0, concurrent=True, first_alone=False)
    on, reused, _ = _decode(llm, prompts, 8192, concurrent=True, first_alone=False)
    assert on == off
    shared = _common(prompts[1], prompts[2]) // 16 * 16  # whole blocks of the system prompt
    assert sorted(reused[1:])[0] == 0 and sorted(reused[1:])[1] >= shared > 100, reused


def test_a_second_turn_reuses_the_first_turns_reply(llm):
    """The whole first exchange (prompt and generated reply) is cached when it finishes."""
    first = _prompts(llm)[0]
    replies, _, _ = _decode(llm, [first], 0, concurrent=False)
    reply = llm.tokenizer.decode(replies[0])
    turn2 = llm.tokenizer.encode_chat([
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": reply}, {"role": "user", "content": "And tomorrow?"},
    ])  # fmt: skip
    off, _, _ = _decode(llm, [first, turn2], 0, concurrent=False)
    on, reused, _ = _decode(llm, [first, turn2], 8192, concurrent=False)
    assert on == off
    assert reused[1] > len(first)  # past the first prompt: into the cached reply


def test_one_tenants_prefix_gives_another_no_hit(llm):
    prompts = _prompts(llm)[:2]
    _, reused, _ = _decode(llm, prompts, 8192, concurrent=False, salts=["key-a", "key-b"])
    assert reused == [0, 0]
    _, reused, _ = _decode(llm, prompts, 8192, concurrent=False, salts=["key-a", "key-a"])
    assert reused[1] > 0


def test_prefill_engine_reuses_and_hands_off_the_same_kv(llm):
    prompts = _prompts(llm)
    config = EngineConfig(max_model_len=1024, prefix_cache_tokens=8192)
    cold = PrefillEngine(llm.model, EngineConfig(max_model_len=1024, prefix_cache_tokens=0))
    warm = PrefillEngine(llm.model, config)
    warm.prefill("w0", prompts[0], PARAMS)
    for i, p in enumerate(prompts[1:]):
        a, b = cold.prefill(f"c{i}", p, PARAMS), warm.prefill(f"w{i}", p, PARAMS)
        assert b.num_reused_tokens > 0 and a.num_reused_tokens == 0
        assert a.first_token == b.first_token
        assert a.kv.num_tokens == b.kv.num_tokens == len(p)
        assert abs(a.kv.k - b.kv.k).max() < 1e-3 and abs(a.kv.v - b.kv.v).max() < 1e-3


def test_decode_keeps_handed_off_kv_named_by_its_prompt(llm):
    """Disaggregated: decode imports a prompt's K/V from prefill; given the prompt's ids it
    keeps those blocks too, so a later prompt decode prefills itself starts from them."""
    prompts = _prompts(llm)
    prefill = PrefillEngine(llm.model, EngineConfig(max_model_len=1024, prefix_cache_tokens=0))
    config = EngineConfig(max_num_seqs=4, max_model_len=1024, prefix_cache_tokens=8192)
    decode = DecodeEngine(llm.model, config, {llm.tokenizer.eos_token_id})
    handed = prefill.prefill("a", prompts[0], PARAMS)
    decode.add_request("a", PARAMS, prefill=handed, prompt_ids=prompts[0])
    decode.add_request("b", PARAMS, prefill=prefill.prefill("b", prompts[1], PARAMS),
                       prompt_ids=prompts[1][:-1])  # fmt: skip  # wrong ids: not cached
    while decode.has_unfinished:
        decode.step()
    decode.add_request("c", PARAMS, prompt_ids=prompts[2])
    first = []
    while decode.has_unfinished:
        first += [o for o in decode.step() if o.index == 0 and o.token_id is not None]
    assert first[0].num_reused_tokens == _common(prompts[0], prompts[2]) // 16 * 16
