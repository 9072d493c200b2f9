"""Serving the GGUF's own Q4_1/Q8_0 blocks (weights "auto", the default) against the dense
fp32 weights those blocks stand for (weights "float32"), on the real model.

What changes is only the order of summation in decode-sized matmuls: the weights are the same
numbers (the block kernels expand each to exactly gguf-py's dequantized value), prefill's
long matmuls multiply the same dense fp32 weights. So greedy replies agree on most prompts and
perplexity stays within 1%; batch invariance, hand-offs and chunked prefill are unchanged."""

from __future__ import annotations

import pytest
import torch
from helpers.batch_invariance import assert_decode_batch_invariant

from disagg.bench.quality import PROMPTS, TEXT, greedy, perplexity
from disagg.engine.config import EngineConfig
from disagg.engine.llm_engine import DecodeEngine, PrefillEngine
from disagg.engine.model import KVCacheSlots, Llama
from disagg.engine.sequence import SamplingParams
from disagg.errors import ConfigError

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def blocks(engine_dir):
    return Llama.load(engine_dir, weights="auto")


@pytest.fixture(scope="module")
def dense(engine_dir):
    return Llama.load(engine_dir, weights="float32")


def test_auto_serves_the_checkpoints_blocks(blocks, dense):
    assert blocks.weights == "q4_1+q8_0"  # layers Q4_1, tied embedding / LM head Q8_0
    assert dense.weights == "float32"
    layer = blocks.layers[0]
    assert layer.w13.blocks.nbytes < layer.w13.dense.weight.numel() * 4 / 5  # type: ignore[union-attr]


def test_greedy_replies_agree_on_most_prompts(llm, blocks, dense):
    same, diverged = 0, []
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    for a, b in zip(greedy(blocks, prompts, 24), greedy(dense, prompts, 24), strict=True):
        if a == b:
            same += 1
        else:  # where they part, both are near ties: the first tokens still agree
            diverged.append(next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y))
    assert same >= 12, (same, diverged)
    assert all(i >= 2 for i in diverged), diverged


def test_perplexity_within_one_percent_of_fp32(llm, blocks, dense):
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) > 60
    q, f = perplexity(blocks, ids), perplexity(dense, ids)
    assert abs(q - f) / f < 0.01, (q, f)


def test_block_decode_is_batch_invariant(llm, blocks):
    assert_decode_batch_invariant(blocks, llm.tokenizer, lengths=(7, 90, 200), seed=0)


def test_handoff_equals_colocated_prefill_with_blocks(llm, blocks):
    ids = llm.tokenizer.encode(TEXT)
    cfg = EngineConfig(max_model_len=512, prefill_chunk_tokens=32)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    handed = PrefillEngine(blocks, cfg).prefill("a", ids, params)

    def run(**kw) -> list[int]:
        eng = DecodeEngine(blocks, cfg, set())
        eng.add_request("a", params, **kw)
        tokens: list[int] = []
        while eng.has_unfinished:
            tokens += [o.token_id for o in eng.step() if o.token_id is not None]
        return tokens

    disagg = [handed.first_token, *run(prefill=handed)]
    assert disagg == run(prompt_ids=ids)  # co-located: prefilled by decode itself


def test_large_batches_stay_on_the_blocks(blocks, dense):
    """The fused step multiplies blocks at any batch size; the torch step would switch to the
    dense kernel past 64 rows, so without the fused step a larger batch is refused."""
    big = EngineConfig(max_model_len=256, max_num_seqs=65)
    DecodeEngine(blocks, big, set())
    DecodeEngine(dense, big, set())
    blocks.fused = False
    try:
        with pytest.raises(ConfigError, match="at most 64 with quantized"):
            DecodeEngine(blocks, big, set())
    finally:
        blocks.fused = True


def test_fused_decode_step_matches_the_torch_step(llm, blocks):
    """The C decode step (norms, RoPE, attention, SiLU: engine/fused_decode.py) computes what
    the torch step does, to float rounding, and writes the same K/V."""
    assert blocks.fused  # the default for the block-quantized CPU engine
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1000, 40000, (n,), generator=g).tolist() for n in (5, 64, 150)]

    def step(fused: bool) -> tuple[torch.Tensor, KVCacheSlots]:
        cache = KVCacheSlots(blocks.args, len(prompts), 256)
        for slot, ids in enumerate(prompts):
            _, k, v = blocks.prefill(ids)
            cache.write(slot, k, v)
        blocks.fused = fused
        try:
            pos = torch.tensor([len(p) for p in prompts])
            return blocks.decode(torch.tensor([42, 7, 1234]), pos, cache), cache
        finally:
            blocks.fused = True

    (c_logits, c_cache), (t_logits, t_cache) = step(True), step(False)
    assert torch.allclose(c_logits, t_logits, atol=1e-3), (c_logits - t_logits).abs().max()
    assert torch.equal(c_logits.argmax(-1), t_logits.argmax(-1))
    assert torch.allclose(c_cache.k, t_cache.k, atol=1e-4)
    assert torch.allclose(c_cache.v, t_cache.v, atol=1e-4)
