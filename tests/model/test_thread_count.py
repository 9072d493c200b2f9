"""A decode step gives the same bits on one thread as on two: decode beside a computing
prefill drops to one thread mid-stream and back (engine/cpu_share.py), so a sequence's
tokens must not depend on when that happened. The real model, the decode engine's kernels,
sequences of different lengths in one batch."""

from __future__ import annotations

import pytest
import torch

from disagg.engine import quant
from disagg.engine.model import KVCacheSlots, Llama

pytestmark = pytest.mark.model

LENGTHS = (37, 70, 129, 200)  # over attention's block edges, unequal: padding in play


def _steps(model: Llama, threads_per_step: list[int]) -> torch.Tensor:
    before = torch.get_num_threads()
    cache = KVCacheSlots(model.args, len(LENGTHS), 512, device=model.device)
    try:
        for slot, n in enumerate(LENGTHS):
            model.prefill_chunk([(7 * slot + 13 * i) % 4000 + 10 for i in range(n)], 0, cache, slot)
        tokens, positions = torch.tensor([11, 12, 13, 14]), torch.tensor(LENGTHS)
        logits = []
        for threads in threads_per_step:
            torch.set_num_threads(threads)
            out = model.decode(tokens, positions, cache)
            logits.append(out.clone())
            tokens, positions = out.argmax(-1), positions + 1
        return torch.stack(logits)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("activations", ["float32", "bfloat16"])
def test_decode_steps_are_the_same_bits_on_one_thread_and_on_two(engine_dir, activations):
    if activations == "bfloat16" and not (quant.available() is None and quant.bf16_simd()):
        pytest.skip("bf16 block products need AVX512-BF16")
    model = Llama.load(engine_dir, weights="auto", activations=activations)
    two = _steps(model, [2] * 12)
    switching = _steps(model, [2, 1, 1, 2, 1, 2, 2, 1, 2, 1, 1, 2])
    assert torch.equal(two, switching), (two - switching).abs().max()


@pytest.mark.parametrize("activations", ["float32", "bfloat16"])
def test_a_prefill_is_the_same_bits_on_one_thread_and_on_two(engine_dir, activations):
    """A prefill's count follows decode layer by layer (cpu_share.PrefillThreads)."""
    if activations == "bfloat16" and not (quant.available() is None and quant.bf16_simd()):
        pytest.skip("bf16 block products need AVX512-BF16")
    model = Llama.load(engine_dir, weights="auto", activations=activations)
    ids = [(11 * i) % 4000 + 10 for i in range(300)]
    before, got = torch.get_num_threads(), []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            cache = KVCacheSlots(model.args, 1, 512, device=model.device)
            logits = model.prefill_chunk(ids, 0, cache, 0)
            got.append(
                (logits.clone(), cache.k[:, 0, :, :300].clone(), cache.v[:, 0, :, :300].clone())
            )
    finally:
        torch.set_num_threads(before)
    for a, b in zip(got[0], got[1], strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
