"""Decode with int8 activations (decode_activations "int8", engine/qdot.c) on the real model,
against the dense fp32 engine: each row of a block product's input is quantized per 32
values (llama.cpp's scheme), so the numbers change: perplexity stays within 1% and greedy
replies agree on most prompts, parting only at near ties after their first tokens.
Batch invariance is kept: a row is quantized alone."""

from __future__ import annotations

import pytest
from helpers.batch_invariance import assert_decode_batch_invariant

from disagg.bench.quality import PROMPTS, TEXT, first_difference, greedy, perplexity
from disagg.engine.model import KVCacheSlots, Llama
from disagg.errors import ConfigError

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def int8(engine_dir):
    return Llama.load(engine_dir, weights="auto", activations="int8")


@pytest.fixture(scope="module")
def dense(engine_dir):
    return Llama.load(engine_dir, weights="float32")


def test_int8_is_taken_only_where_blocks_are_served(engine_dir, int8, dense):
    assert int8.activations == "int8" and int8.fused
    assert Llama.load(engine_dir, weights="float32", activations="int8").activations == "float32"
    with pytest.raises(ConfigError, match="activations must be one of"):
        Llama.load(engine_dir, activations="int4")


def test_perplexity_within_one_percent_of_fp32(llm, int8, dense):
    ids = llm.tokenizer.encode(TEXT)
    q, f = perplexity(int8, ids), perplexity(dense, ids)
    assert abs(q - f) / f < 0.01, (q, f)


def test_greedy_replies_part_from_fp32_only_at_near_ties(llm, int8, dense):
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    replies = zip(greedy(int8, prompts, 24), greedy(dense, prompts, 24), strict=True)
    parts = [
        (ids, a, b, first_difference(a, b)) for ids, (a, b) in zip(prompts, replies, strict=True)
    ]
    # How many stay equal depends on the CPU's kernels (10 of 16 on an Intel Xeon with AMX,
    # 6 on an AMD EPYC Zen 4): which near ties tip is chance. What must hold on every CPU:
    # the first token comes from prefill (dense fp32 either way) and the next ones agree, and
    # where a reply parts, fp32 itself found int8's token nearly as likely as its own (its
    # logit within 0.5; measured on Zen 4: 0.005-0.30, the two tokens' probabilities 0.39 vs
    # 0.39 at the closest and 0.18 vs 0.13 at the widest).
    assert sum(i is None for *_, i in parts) >= len(parts) // 4, [i for *_, i in parts]
    for ids, a, b, i in parts:
        if i is None:
            continue
        assert i >= 2, (i, a, b)
        cache = KVCacheSlots(dense.args, 1, len(ids) + i + 1)
        logits = dense.prefill_chunk(ids + b[:i], 0, cache, 0)
        assert float(logits[b[i]] - logits[a[i]]) < 0.5, (i, b[i], a[i])


def test_int8_decode_is_batch_invariant(llm, int8):
    assert_decode_batch_invariant(int8, llm.tokenizer)
