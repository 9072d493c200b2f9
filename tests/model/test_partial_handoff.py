"""Hand-offs that carry only what decode lacks, with the real model: a second turn's payload
leaves out the blocks decode kept from the first turn (prompt and reply), decode copies them
from its prefix cache, and the greedy reply equals the one a whole payload gives. A prefix
decode no longer holds is a typed, retryable error, never a wrong reply."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from disagg.engine.config import EngineConfig
from disagg.engine.llm_engine import DecodeEngine, PrefillEngine, PrefillResult
from disagg.engine.sequence import SamplingParams
from disagg.errors import KVPrefixMissError
from disagg.pipeline.handoff import skip_tokens

pytestmark = pytest.mark.model
SYSTEM = "You are the harbour master's assistant. Answer in one or two short sentences. " * 3
PARAMS = SamplingParams(max_tokens=16)


def _decode_engine(llm, cache_tokens: int = 8192) -> DecodeEngine:
    config = EngineConfig(max_num_seqs=2, max_model_len=1024, prefix_cache_tokens=cache_tokens)
    return DecodeEngine(llm.model, config, {llm.tokenizer.eos_token_id})


def _run(decode: DecodeEngine, request_id: str) -> list[int]:
    out = []
    while decode.has_unfinished:
        step = decode.step()
        out += [o.token_id for o in step if o.request_id == request_id and o.token_id is not None]
    return out


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass(frozen=True)
class Turns:
    prompt1: list[int]
    reply1: list[int]  # as decode produced it
    prompt2: list[int]  # the conversation so far and the next question
    handoff1: PrefillResult  # turn 1's whole hand-off
    whole: PrefillResult  # turn 2's whole hand-off
    part: PrefillResult  # turn 2's, without what decode kept of turn 1
    skip: int


@pytest.fixture(scope="module")
def turns(llm) -> Turns:
    prefill = PrefillEngine(llm.model, EngineConfig(max_model_len=1024, prefix_cache_tokens=0))
    decode = _decode_engine(llm)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tide?"}]
    prompt1 = llm.tokenizer.encode_chat(history)
    handoff1 = prefill.prefill("t1", prompt1, PARAMS)
    decode.add_request("t1", PARAMS, prefill=handoff1, prompt_ids=prompt1)
    reply1 = [handoff1.first_token] + _run(decode, "t1")
    history += [
        {"role": "assistant", "content": llm.tokenizer.decode(reply1)},
        {"role": "user", "content": "And tomorrow at dusk?"},
    ]
    prompt2 = llm.tokenizer.encode_chat(history)
    # decode keeps turn 1's prompt and reply but the last token (no K/V yet)
    skip = skip_tokens(_common(prompt1 + reply1[:-1], prompt2), len(prompt2), 16)
    whole = prefill.prefill("w", prompt2, PARAMS)
    part = prefill.prefill("p", prompt2, PARAMS, skip)
    return Turns(prompt1, reply1, prompt2, handoff1, whole, part, skip)


def _after_turn1(llm, turns: Turns, cache_tokens: int = 8192) -> DecodeEngine:
    """A decode engine that served turn 1 from its whole hand-off (it keeps prompt + reply)."""
    decode = _decode_engine(llm, cache_tokens)
    decode.add_request("t1", PARAMS, prefill=turns.handoff1, prompt_ids=turns.prompt1)
    assert [turns.handoff1.first_token] + _run(decode, "t1") == turns.reply1
    return decode


@pytest.fixture(scope="module")
def reference(llm, turns) -> list[int]:
    """Turn 2's greedy reply from its whole hand-off."""
    decode = _after_turn1(llm, turns)
    decode.add_request("w", PARAMS, prefill=turns.whole, prompt_ids=turns.prompt2)
    return _run(decode, "w")


def _evict_everything(decode: DecodeEngine) -> None:
    """Fill decode's prefix cache with another prompt's blocks (least recently used go)."""
    reuse = decode.kv_reuse
    assert reuse is not None
    other = list(range(1000, 1000 + reuse.index.stats.capacity_tokens))
    _, layers, heads, _, dim = reuse.store.k.shape
    zeros = torch.zeros(layers, heads, len(other), dim)
    evicted = reuse.index.stats.num_evicted_blocks
    reuse.save(other, "", zeros, zeros)
    assert reuse.index.stats.num_evicted_blocks > evicted


def test_prefill_computes_the_whole_prompt_and_packs_only_from_the_skip(turns):
    part, whole, skip = turns.part.kv, turns.whole.kv, turns.skip
    assert (part.start, part.num_tokens, part.num_prompt_tokens) == (
        skip,
        len(turns.prompt2) - skip,
        whole.num_tokens,
    )
    assert turns.part.first_token == turns.whole.first_token
    np.testing.assert_array_equal(part.k, whole.k[:, :, skip:])
    assert part.nbytes == part.num_tokens * 46080  # only what decode lacks travels


def test_a_second_turns_partial_hand_off_replies_as_a_whole_one(llm, turns, reference):
    assert turns.skip > len(turns.prompt1)  # past the first prompt: into the reply decode made
    assert turns.part.kv.nbytes < 0.5 * turns.whole.kv.nbytes
    decode = _after_turn1(llm, turns)
    decode.add_request("p", PARAMS, prefill=turns.part, prompt_ids=turns.prompt2)
    assert decode.kv_reuse.index.stats.num_hit_tokens == turns.skip  # from its own cache
    assert _run(decode, "p") == reference and len(reference) >= 4


def test_a_prefix_copied_at_arrival_survives_its_eviction(llm, turns, reference):
    decode = _after_turn1(llm, turns, cache_tokens=512)
    decode.add_request("p", PARAMS, prefill=turns.part, prompt_ids=turns.prompt2)
    _evict_everything(decode)  # before the sequence is admitted
    assert _run(decode, "p") == reference


def test_a_prefix_decode_no_longer_holds_is_a_typed_error_and_a_whole_payload_still_works(
    llm, turns, reference
):
    decode = _after_turn1(llm, turns, cache_tokens=512)
    _evict_everything(decode)
    with pytest.raises(KVPrefixMissError, match="holds 0 of the"):
        decode.add_request("p", PARAMS, prefill=turns.part, prompt_ids=turns.prompt2)
    assert not decode.has_unfinished  # refused whole: nothing queued
    with pytest.raises(KVPrefixMissError):  # restarted: an empty cache
        _decode_engine(llm).add_request("p", PARAMS, prefill=turns.part, prompt_ids=turns.prompt2)
    other_key = SamplingParams(max_tokens=PARAMS.max_tokens, cache_salt="another key")
    with pytest.raises(KVPrefixMissError):  # another key's namespace holds none of it
        _after_turn1(llm, turns).add_request(
            "p", other_key, prefill=turns.part, prompt_ids=turns.prompt2
        )
    # the orchestrator's retry: the whole prompt's hand-off
    decode.add_request("p", PARAMS, prefill=turns.whole, prompt_ids=turns.prompt2)
    assert _run(decode, "p") == reference
