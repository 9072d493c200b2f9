"""The optional bf16 matmul path: refused clearly where the CPU lacks native bf16; where it
has it, close to fp32 (tolerances stated below). Unlike fp32, oneDNN's bf16 kernels change
with the batch size, so bf16 decode is *not* bit-for-bit batch invariant: a sequence's logits
in a batch stay within the same tolerance of its logits alone (docs/benchmarks.md)."""

import pytest
import torch

from disagg.errors import ConfigError
from disagg.model import KVCacheSlots, Llama, bf16_supported
from disagg.sequence import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]
# bf16 keeps 8 bits of mantissa: logits (magnitude ~30) move by up to ~0.5; the argmax agrees
# with fp32 at >= 85% of positions (seen here: ~92%).
MAX_LOGIT_DIFF = 1.5
MIN_TOP1_AGREEMENT = 0.85


@pytest.fixture(scope="module")
def bf16(engine_dir):
    if not bf16_supported():
        return None
    return Llama.load(engine_dir, "bfloat16")


def test_bf16_is_refused_clearly_without_native_support(engine_dir, bf16):
    if bf16_supported():
        assert bf16.layers[0].w13.weight.dtype == torch.bfloat16
        assert bf16.lm_head.weight.dtype == torch.float32  # logits stay fp32
    else:
        with pytest.raises(ConfigError, match="native bf16"):
            Llama.load(engine_dir, "bfloat16")
    with pytest.raises(ConfigError, match="compute_dtype must be one of"):
        Llama.load(engine_dir, "float16")


def test_bf16_logits_stay_close_to_fp32(llm, bf16):
    if bf16 is None:
        pytest.skip("no native bf16 on this CPU (the refusal is tested above)")
    agree, total = 0, 0
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        ref, _, _ = llm.model.prefill(ids, all_logits=True)
        got, _, _ = bf16.prefill(ids, all_logits=True)
        assert (got - ref).abs().max().item() <= MAX_LOGIT_DIFF
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= MIN_TOP1_AGREEMENT


def test_bf16_decode_in_a_batch_stays_close_and_answers(engine_dir, llm, bf16):
    if bf16 is None:
        pytest.skip("no native bf16 on this CPU (the refusal is tested above)")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    cache = KVCacheSlots(bf16.args, max_slots=len(prompts), max_len=256)

    def step(order):
        for slot, i in enumerate(order):
            _, k, v = bf16.prefill(prompts[i])
            cache.write(slot, k.numpy(), v.numpy())
        pos = torch.tensor([len(prompts[i]) for i in order])
        return bf16.decode(torch.full((len(order),), 42), pos, cache)

    alone = [step([i])[0] for i in range(len(prompts))]
    batched = step([2, 0, 1])
    for slot, i in enumerate([2, 0, 1]):
        assert (batched[slot] - alone[i]).abs().max().item() <= MAX_LOGIT_DIFF
        assert batched[slot].argmax() == alone[i].argmax()
    from disagg.llm import LLM

    reply = LLM(engine_dir, compute_dtype="bfloat16").generate(
        ["What is the capital of France? Answer in one word."], SamplingParams(max_tokens=16)
    )
    assert "Paris" in reply[0].text
