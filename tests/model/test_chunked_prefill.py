"""Chunked prefill in the decode engine: a prompt decode prefills itself runs in chunks of
`prefill_chunk_tokens` inside decode steps, so running sequences get a token every step while
a long prompt arrives; what changes against a whole prefill is measured here."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.config import EngineConfig
from disagg.engine.llm_engine import DecodeEngine, PrefillEngine
from disagg.engine.model import KVCacheSlots
from disagg.engine.sequence import SamplingParams

pytestmark = pytest.mark.model
CHUNK = 128


def long_prompt(llm, n: int) -> list[int]:
    text = " ".join(
        f"Item {i}: a note about the harbour, the boats and the weather." for i in range(80)
    )
    ids = llm.encode(f"Summarise these notes.\n{text}")
    assert len(ids) >= n
    return ids[:n]


# chunk-by-chunk against whole: fp32 sums in another order only; bf16 (the default where
# the CPU has it) also rounds activations by a kernel that depends on the row count, so a
# 64-row chunk and a 300-row prefill differ by bf16 rounding (seen: K 0.21, logits 0.21)
TOLERANCE = {"float32": (1e-4, 1e-3), "bfloat16": (0.5, 1.0)}  # K/V, logits


def test_chunk_by_chunk_is_the_whole_prefill_within_float_error(llm):
    model, prompt = llm.model, long_prompt(llm, 300)
    kv_tol, logit_tol = TOLERANCE[model.compute_dtype]
    logits, k, v = model.prefill(prompt)
    cache = KVCacheSlots(model.args, 2, 512, device=model.device)
    for start in range(0, len(prompt), 64):
        chunk_logits = model.prefill_chunk(prompt[start : start + 64], start, cache, slot=1)
    assert torch.allclose(cache.k[:, 1, :, :300], k, atol=kv_tol)
    assert torch.allclose(cache.v[:, 1, :, :300], v, atol=kv_tol)
    assert (chunk_logits - logits).abs().max() < logit_tol
    assert int(chunk_logits.argmax()) == int(logits.argmax())


def _engine(llm, chunk=CHUNK):
    config = EngineConfig(max_num_seqs=4, max_model_len=1024, prefill_chunk_tokens=chunk)
    return DecodeEngine(llm.model, config, {llm.tokenizer.eos_token_id}), config


def test_running_sequences_get_a_token_every_step_while_a_long_prompt_prefills(llm):
    engine, config = _engine(llm)
    short = llm.encode("Tell me about the sea.")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = _decode_alone(llm, short, params)
    engine.add_request("run", params, prompt_ids=short)
    got = {"run": [], "long": []}
    for o in engine.step():
        got[o.request_id].append(o.token_id)
    long = long_prompt(llm, 700)
    engine.add_request("long", SamplingParams(max_tokens=8, ignore_eos=True), prompt_ids=long)
    steps_until_first = 0
    while not got["long"]:
        before = len(got["run"])
        for o in engine.step():
            if o.token_id is not None:
                got[o.request_id].append(o.token_id)
        steps_until_first += 1
        assert len(got["run"]) == before + 1  # its rhythm: one token per step, every step
    assert steps_until_first == -(-len(long) // CHUNK)  # 6 chunks of <= 128 tokens
    while engine.has_unfinished:
        for o in engine.step():
            if o.token_id is not None:
                got[o.request_id].append(o.token_id)
    assert got["run"] == alone  # batch invariant: the placeholder rows change nothing


def _decode_alone(llm, prompt, params, chunk=CHUNK, beside: list[int] | None = None):
    """Greedy tokens of `prompt`, co-located; with `beside`, another sequence decodes all the
    while (a prompt is only chunked when someone else is decoding)."""
    engine, _ = _engine(llm, chunk)
    if beside is not None:
        engine.add_request("other", SamplingParams(max_tokens=200, ignore_eos=True),
                           prompt_ids=beside)  # fmt: skip
        engine.step()
    engine.add_request("a", params, prompt_ids=prompt)
    out = []
    while any(rid == "a" for rid in engine._seqs):
        out += [o.token_id for o in engine.step() if o.token_id is not None and o.request_id == "a"]
    return out


def test_a_prompt_alone_is_prefilled_whole(llm):
    engine, _ = _engine(llm)
    engine.add_request("a", SamplingParams(max_tokens=2), prompt_ids=long_prompt(llm, 700))
    first = [o for o in engine.step() if o.request_id == "a" and o.token_id is not None]
    assert first and first[0].index == 0  # its first token in the first step


def test_what_chunking_changes_in_greedy_replies(llm):
    """Prompts up to one chunk are prefilled whole: token for token today's. Longer ones:
    the chunked reply is compared with the prefill engine's (disaggregated) reply."""
    engine_prefill = PrefillEngine(llm.model, EngineConfig(max_model_len=1024))
    params = SamplingParams(max_tokens=24)
    beside = llm.encode("Tell me about the sea.")
    for n in (CHUNK, 300, 700):
        prompt = long_prompt(llm, n)
        chunked = _decode_alone(llm, prompt, params, beside=beside)
        result = engine_prefill.prefill("p", prompt, params)
        engine, _ = _engine(llm)
        engine.add_request("p", params, prefill=result)
        disagg = [result.first_token]
        while engine.has_unfinished:
            disagg += [o.token_id for o in engine.step() if o.token_id is not None]
        assert chunked == disagg, n


def test_a_burst_of_prompts_beside_fewer_decoding_sequences_is_prefilled_whole(llm):
    """Three 300-token prompts arrive while one sequence decodes: the prompts are the many,
    so all three are prefilled in the next step (not 8 steps of 128 tokens one after the
    other), and their replies are the ones each gets prefilled alone. One long prompt beside
    a running sequence keeps the plain chunk (the tests above)."""
    engine, _ = _engine(llm)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("run", SamplingParams(max_tokens=40, ignore_eos=True),
                       prompt_ids=llm.encode("Tell me about the sea."))  # fmt: skip
    engine.step()
    burst = [long_prompt(llm, 300)[i:] + [11] * i for i in range(3)]  # 300 tokens each
    for i, prompt in enumerate(burst):
        engine.add_request(f"b{i}", params, prompt_ids=prompt)
    got: dict[str, list[int]] = {f"b{i}": [] for i in range(3)}
    for o in engine.step():
        if o.request_id in got and o.token_id is not None:
            got[o.request_id].append(o.token_id)
    assert all(got.values()), got  # every first token (and a decoded one) in one step
    while engine.has_unfinished:
        for o in engine.step():
            if o.request_id in got and o.token_id is not None:
                got[o.request_id].append(o.token_id)
    for i, prompt in enumerate(burst):
        assert got[f"b{i}"] == _decode_alone(llm, prompt, params), i


def test_a_burst_is_prefilled_a_capped_number_of_tokens_a_step(llm):
    """Four 300-token prompts arriving together with a cap of 600 tokens a step: two first
    tokens leave after the first step (not all four after one long step); the other two,
    now no more than the decoding ones, go on in chunks; every reply is the one each gets
    prefilled alone."""
    config = EngineConfig(
        max_num_seqs=4, max_model_len=1024, prefill_chunk_tokens=CHUNK, burst_prefill_tokens=600,
        prefix_cache_tokens=0,
    )  # fmt: skip
    engine = DecodeEngine(llm.model, config, {llm.tokenizer.eos_token_id})
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    burst = [long_prompt(llm, 300)[i:] + [11] * i for i in range(4)]
    for i, prompt in enumerate(burst):
        engine.add_request(f"b{i}", params, prompt_ids=prompt)
    got: dict[str, list[int]] = {f"b{i}": [] for i in range(4)}
    firsts = []
    while engine.has_unfinished:
        outs = [o for o in engine.step() if o.token_id is not None]
        firsts.append(sum(o.index == 0 for o in outs))
        for o in outs:
            got[o.request_id].append(o.token_id)
    assert firsts[0] == 2 and sum(firsts) == 4, firsts
    for i, prompt in enumerate(burst):
        assert got[f"b{i}"] == _decode_alone(llm, prompt, params), i
