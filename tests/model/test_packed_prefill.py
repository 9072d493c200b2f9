"""Prompt chunks prefilled in one forward (engine/packed_prefill.py) give what each gives
alone with `prefill_chunk`, bit for bit: logits and every K/V position written. Chunks of both
kernel groups (at most the model's prompt_rows rows: blocks; longer: dense), fresh and after cached
positions, in one pack; the engine default and the dense float32 weights."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.model import KVCacheSlots, Llama
from disagg.engine.packed_prefill import Chunk
from disagg.engine.quant import PROMPT_ROWS

pytestmark = pytest.mark.model


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


# (tokens, start): a blocks-sized chunk after cached positions, one prompt's first dense-sized
# chunk, a single token, a dense-sized chunk after cached positions, one exactly PROMPT_ROWS
# (the fused engine's last row count on blocks), 87 rows split unevenly among 5 threads, a
# decode-sized chunk (64: dense since 2026-12-06) after cached positions
SHAPES = [(5, 96), (150, 0), (1, 7), (PROMPT_ROWS + 1, 32), (PROMPT_ROWS, 0), (87, 3), (64, 40)]


def _prefix(model, cache, slot: int, start: int, seed: int) -> None:
    if start:
        model.prefill_chunk(_ids(start, seed + 100), 0, cache, slot)


@pytest.fixture
def threads(request):
    """torch's thread count for the test (elementwise ops split their work by it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("weights", "threads"), [("auto", 2), ("float32", 2), ("auto", 5)], indirect=["threads"]
)
def test_a_pack_of_chunks_equals_each_chunk_alone(engine_dir, llm, weights, threads):
    model = llm.model if weights == "auto" else Llama.load(engine_dir, weights="float32")
    if weights == "auto":  # decode fused: prompt rows leave the blocks early
        assert model.prompt_rows == PROMPT_ROWS
    chunks = [Chunk(_ids(n, i), start, slot=i) for i, (n, start) in enumerate(SHAPES)]
    alone = KVCacheSlots(model.args, len(SHAPES), 512, device=model.device)
    packed = KVCacheSlots(model.args, len(SHAPES), 512, device=model.device)
    want = []
    for i, c in enumerate(chunks):
        _prefix(model, alone, c.slot, c.start, i)
        _prefix(model, packed, c.slot, c.start, i)
        want.append(model.prefill_chunk(c.token_ids, c.start, alone, c.slot))
    got = model.prefill_chunks(chunks, packed)
    for c, w, g in zip(chunks, want, got, strict=True):
        assert torch.equal(w, g), (len(c.token_ids), c.start, (w - g).abs().max())
    assert torch.equal(alone.k, packed.k) and torch.equal(alone.v, packed.v)
