"""One check for every decode path: each sequence's logits alone equal its row in a batch."""

from __future__ import annotations

import torch

from disagg.bench.quality import PROMPTS
from disagg.engine.model import KVCacheSlots, Llama


def assert_decode_batch_invariant(model: Llama, tokenizer, lengths=(9, 120), seed: int = 1):
    """The first three fixed prompts plus random ones of `lengths`, each decoded one step
    alone and then all together in reverse slot order: equal bit for bit."""
    g = torch.Generator().manual_seed(seed)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    prompts += [torch.randint(1000, 40000, (int(n),), generator=g).tolist() for n in lengths]
    cache = KVCacheSlots(model.args, max_slots=len(prompts), max_len=256)

    def step(order: list[int]) -> torch.Tensor:
        for slot, i in enumerate(order):
            _, k, v = model.prefill(prompts[i])
            cache.write(slot, k, v)
        pos = torch.tensor([len(prompts[i]) for i in order])
        return model.decode(torch.full((len(order),), 42), pos, cache)

    alone = [step([i])[0] for i in range(len(prompts))]
    order = list(range(len(prompts)))[::-1]
    batch = step(order)
    for slot, i in enumerate(order):
        assert torch.equal(batch[slot], alone[i]), (slot, i)
