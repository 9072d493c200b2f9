"""The checkpoint's blocks multiplied in bf16 arithmetic (activations "bfloat16",
engine/qbf16.c) on the real model, against the dense fp32 engine: refused clearly on a CPU
without AVX512-BF16; where it runs, perplexity within 1% and greedy replies equal on most
prompts (bf16 rounds both factors of every product, as a bf16 checkpoint served in bf16
does), batch invariant bit for bit, and one arithmetic for prefill and decode at every row
count, so a cached prefix hands off the K/V a cold prompt gets."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.batch_invariance import assert_decode_batch_invariant

from disagg.bench.quality import PROMPTS, TEXT, first_difference, greedy, perplexity
from disagg.engine import quant
from disagg.engine.config import EngineConfig
from disagg.engine.kernels import BlockLinear
from disagg.engine.kv_reuse import kv_reuse_for
from disagg.engine.llm_engine import PrefillEngine
from disagg.engine.model import KVCacheSlots, Llama
from disagg.engine.sequence import SamplingParams
from disagg.errors import ConfigError

pytestmark = pytest.mark.model

HAS_BF16 = quant.available() is None and quant.bf16_simd()


@pytest.fixture(scope="module")
def bf16(engine_dir):
    if not HAS_BF16:
        pytest.skip("bf16 block products need AVX512-BF16 (the refusal is tested below)")
    return Llama.load(engine_dir, weights="auto", activations="bfloat16")


@pytest.fixture(scope="module")
def dense(engine_dir):
    return Llama.load(engine_dir, weights="float32")


def test_refused_clearly_without_avx512_bf16_else_every_block_product_is_bf16(engine_dir):
    if quant.available() is not None:
        pytest.skip(f"no block kernels here: {quant.available()}")
    if not HAS_BF16:
        with pytest.raises(ConfigError, match="AVX512-BF16"):
            Llama.load(engine_dir, weights="auto", activations="bfloat16")
        return
    model = Llama.load(engine_dir, weights="auto", activations="bfloat16")
    lins = [model.lm_head] + [
        lin for layer in model.layers for lin in (layer.wqkv, layer.wo, layer.w13, layer.w2)
    ]
    assert model.activations == "bfloat16" and model.fused
    # no dense copy kept: the blocks serve prefill's rows too
    assert all(isinstance(x, BlockLinear) and x.activations == "bfloat16" for x in lins)
    assert all(isinstance(x, BlockLinear) and x.dense is None for x in lins)
    dense = Llama.load(engine_dir, weights="float32", activations="bfloat16")
    assert dense.activations == "float32"  # dense weights: nothing to take it


def test_perplexity_within_one_percent_of_fp32(llm, bf16, dense):
    ids = llm.tokenizer.encode(TEXT)
    b, f = perplexity(bf16, ids), perplexity(dense, ids)
    assert abs(b - f) / f < 0.01, (b, f)  # measured: +0.07%


def test_greedy_replies_agree_on_most_prompts(llm, bf16, dense):
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    parts = [
        first_difference(a, b)
        for a, b in zip(greedy(bf16, prompts, 24), greedy(dense, prompts, 24), strict=True)
    ]
    assert sum(p is None for p in parts) >= 10, parts  # measured: 13 of 16 (dense bf16: 13)


def test_decode_is_batch_invariant(llm, bf16):
    assert_decode_batch_invariant(bf16, llm.tokenizer)


def test_a_cached_prefix_hands_off_the_kv_a_cold_prompt_gets(llm, bf16):
    """The check that kept a bf16 dense copy for prefill out (docs/benchmarks.md): prompt
    rows up to 64 and beyond must meet one arithmetic."""
    system = "You are a harbour master's assistant; answer in one or two sentences. " * 6
    prompts = [
        llm.tokenizer.encode_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": q}]
        )
        for q in ("When is high tide today?", "Which berth takes a 90 metre ship?")
    ]
    params = SamplingParams(max_tokens=8)
    cold = PrefillEngine(bf16, EngineConfig(max_model_len=1024, prefix_cache_tokens=0))
    warm = PrefillEngine(bf16, EngineConfig(max_model_len=1024, prefix_cache_tokens=8192))
    warm.prefill("w0", prompts[0], params)
    a, b = cold.prefill("c", prompts[1], params), warm.prefill("w", prompts[1], params)
    assert b.num_reused_tokens > 64 and a.num_reused_tokens == 0  # the rest: < 64 rows
    assert a.first_token == b.first_token
    assert np.array_equal(a.kv.k, b.kv.k) and np.array_equal(a.kv.v, b.kv.v)


def test_short_prompts_after_the_template_s_cached_blocks_equal_cold_ones_bit_for_bit(llm, bf16):
    """Once 0.06 apart (greedy replies parted at token 10): the tail's attention rows were
    rounded by torch with the rows beside them, and bf16 rounding made that a whole step."""
    params = SamplingParams(max_tokens=4)
    warm = PrefillEngine(bf16, EngineConfig(max_model_len=1024, prefix_cache_tokens=8192))
    cold = PrefillEngine(bf16, EngineConfig(max_model_len=1024, prefix_cache_tokens=0))
    reused = 0
    for p in PROMPTS[:6]:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": p}])
        a, b = cold.prefill("c", ids, params), warm.prefill("w", ids, params)
        reused += b.num_reused_tokens
        assert np.array_equal(a.kv.k, b.kv.k) and np.array_equal(a.kv.v, b.kv.v), p
    assert reused >= 5 * 16  # the template's blocks came from the cache


def test_decoded_tokens_kv_equals_the_same_tokens_prefilled_bit_for_bit(llm, bf16):
    """A decode step's rows and prompt rows meet one arithmetic (the attention too:
    layers.prompt_attention in C), so whatever recomputes a conversation as a prompt (a
    migration's or a restart's recompute, a fallback from damaged K/V, the next turn after
    a cached answer) gets the K/V its decode steps wrote, and greedy goes on the same."""
    torch = pytest.importorskip("torch")
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    n, steps = len(ids), 12
    cache = KVCacheSlots(bf16.args, max_slots=1, max_len=n + steps + 1)
    logits, k, v = bf16.prefill(ids)
    cache.write(0, k, v)
    out = [int(logits.argmax())]
    for i in range(steps):
        pos = torch.tensor([n + i])
        out.append(int(bf16.decode(torch.tensor([out[-1]]), pos, cache)[0].argmax()))
    whole = ids + out[:-1]  # every token whose K/V decode wrote
    logits, k, v = bf16.prefill(whole)
    m = len(whole)
    assert torch.equal(cache.k[:, 0, :, :m], k) and torch.equal(cache.v[:, 0, :, :m], v)
    assert int(logits.argmax()) == out[-1]


def test_its_prefix_blocks_are_named_apart_from_fp32_activations_ones(engine_dir, bf16):
    """Both pools compute so (the prefill pool takes decode_activations too), and their
    caches' chains start from a root of their own: a block computed with fp32 activations is
    never taken for one computed in bf16, by an engine or by a frontend's replica choice."""
    config = EngineConfig(max_model_len=1024, prefix_cache_tokens=1024)
    fp32 = kv_reuse_for(Llama.load(engine_dir, weights="auto"), config)
    ours = kv_reuse_for(bf16, config)
    assert fp32 is not None and ours is not None and fp32.root != ours.root


def test_a_cpu_without_avx512_bf16_gets_a_clear_error(engine_dir, monkeypatch):
    """What the first test checks on such a CPU, here on any CPU with the block kernels."""
    if quant.available() is not None:
        pytest.skip(f"no block kernels here: {quant.available()}")
    monkeypatch.setattr(quant, "bf16_simd", lambda: False)
    with pytest.raises(ConfigError, match="AVX512-BF16.*use float32 or int8"):
        Llama.load(engine_dir, weights="auto", activations="bfloat16")
