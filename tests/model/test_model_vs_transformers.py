"""Our model's logits against Hugging Face transformers loading the same GGUF.

Tolerance: max |difference| <= 2e-3 on logits of magnitude ~30 (fp32 on both sides; what
remains is summation order). Seen here: about 1e-4."""

import pytest
import torch

from disagg.engine.model import KVCacheSlots, Llama

pytestmark = pytest.mark.model

ATOL = 2e-3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "分离式推理把预填充和解码放在不同的进程里。",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    from disagg.engine.checkpoint import find_packaged_smollm2

    g = find_packaged_smollm2()
    model = AutoModelForCausalLM.from_pretrained(
        str(g.parent), gguf_file=g.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def fp32(llm, engine_dir):
    """Our model in fp32, like the reference (the served default may be bf16 here)."""
    if llm.model.compute_dtype == "float32":
        return llm.model
    return Llama.load(engine_dir, "float32", str(llm.model.device))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_logits_match_at_every_position(llm, fp32, reference, prompt):
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]  # [S, V]
    ours = fp32.prefill(ids, all_logits=True)[0].cpu()  # the engine may run on a GPU
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= ATOL
    last = fp32.prefill(ids)[0].cpu()  # the serving path computes the last position only
    assert torch.equal(last, ours[-1]) or (last - ref[-1]).abs().max().item() <= ATOL


def test_decode_logits_match_with_a_batch_of_different_lengths(llm, fp32, reference):
    """Prefill part of each prompt, then decode the rest token by token, all prompts in one
    batch at different positions: every step's logits match the reference."""
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    cache = KVCacheSlots(fp32.args, max_slots=len(prompts), max_len=128, device=fp32.device)
    refs = []
    for slot, ids in enumerate(prompts):
        with torch.no_grad():
            refs.append(reference(torch.tensor([ids])).logits[0])
        _, k, v = fp32.prefill(ids[:-4])
        cache.write(slot, k, v)
    for step in range(4):
        pos = torch.tensor([len(ids) - 4 + step for ids in prompts])
        tokens = torch.tensor([ids[p] for ids, p in zip(prompts, pos.tolist(), strict=True)])
        out = fp32.decode(tokens, pos, cache).cpu()
        for b, ref in enumerate(refs):
            assert (out[b] - ref[pos[b]]).abs().max().item() <= ATOL


def test_decode_is_batch_invariant_bit_for_bit(llm):
    """A sequence's logits are identical alone and in a batch beside longer sequences, which
    is what lets continuous batching promise the same tokens as decoding alone."""
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    model = llm.model
    cache = KVCacheSlots(model.args, max_slots=len(prompts), max_len=256, device=model.device)

    def step(order):
        for slot, i in enumerate(order):
            _, k, v = model.prefill(prompts[i])
            cache.write(slot, k, v)
        pos = torch.tensor([len(prompts[i]) for i in order])
        return model.decode(torch.full((len(order),), 42), pos, cache).cpu()

    alone = [step([i])[0] for i in range(len(prompts))]
    order = [2, 0, 3, 1]
    batched = step(order)
    for slot, i in enumerate(order):
        assert torch.equal(batched[slot], alone[i])
