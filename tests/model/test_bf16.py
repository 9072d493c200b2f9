"""The bf16 matmul path, the default (compute_dtype auto) where the CPU has native bf16:
refused clearly where it lacks it; where it has it, close to fp32 (tolerances stated below)
and, like fp32, batch invariant bit for bit: oneDNN's single-row bf16 kernel rounds
differently on some inputs, so one row runs as two (docs/benchmarks.md)."""

import pytest
import torch

from disagg.engine.kernels import bf16_supported, resolve_compute_dtype
from disagg.engine.model import KVCacheSlots, Llama
from disagg.engine.sequence import SamplingParams
from disagg.errors import ConfigError

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
    return Llama.load(engine_dir, weights="bfloat16")  # dense bf16, not the GGUF blocks


@pytest.fixture(scope="module")
def fp32(engine_dir):
    return Llama.load(engine_dir, weights="float32")


def test_auto_is_bf16_exactly_where_the_cpu_has_it(engine_dir, llm):
    want = "bfloat16" if bf16_supported() else "float32"
    assert resolve_compute_dtype("auto") == want
    assert llm.model.compute_dtype == want or llm.model.device.type != "cpu"  # LLM: auto
    assert resolve_compute_dtype("float32") == "float32"


def test_bf16_is_refused_clearly_without_native_support(engine_dir, bf16):
    if bf16_supported():
        assert bf16.layers[0].w13.weight.dtype == torch.bfloat16
        assert bf16.lm_head.weight.dtype == torch.float32  # logits stay fp32
    else:
        with pytest.raises(ConfigError, match="native bf16"):
            Llama.load(engine_dir, "bfloat16")
    with pytest.raises(ConfigError, match="compute_dtype must be one of"):
        Llama.load(engine_dir, "float16")


def test_bf16_logits_stay_close_to_fp32(llm, fp32, bf16):
    if bf16 is None:
        pytest.skip("no native bf16 on this CPU (the refusal is tested above)")
    agree, total = 0, 0
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        ref, _, _ = fp32.prefill(ids, all_logits=True)
        got, _, _ = bf16.prefill(ids, all_logits=True)
        assert (got - ref).abs().max().item() <= MAX_LOGIT_DIFF
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= MIN_TOP1_AGREEMENT


def test_bf16_decode_is_batch_invariant_and_answers(engine_dir, llm, bf16):
    if bf16 is None:
        pytest.skip("no native bf16 on this CPU (the refusal is tested above)")
    g = torch.Generator().manual_seed(0)
    # prompts of many lengths (the batch's attention span is the longest one's), token ids
    # from the vocabulary: random activations passed oneDNN's one-row probe, these did not
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    prompts += [
        torch.randint(1000, 40000, (int(n),), generator=g).tolist()
        for n in torch.randint(5, 300, (13,), generator=g)
    ]
    cache = KVCacheSlots(bf16.args, max_slots=len(prompts), max_len=512)

    def step(order):
        for slot, i in enumerate(order):
            _, k, v = bf16.prefill(prompts[i])
            cache.write(slot, k.numpy(), v.numpy())
        pos = torch.tensor([len(prompts[i]) for i in order])
        return bf16.decode(torch.full((len(order),), 42), pos, cache)

    alone = [step([i])[0] for i in range(len(prompts))]
    for n in (2, 5, len(prompts)):
        order = list(range(n))[::-1]
        batched = step(order)
        for slot, i in enumerate(order):
            assert torch.equal(batched[slot], alone[i]), (n, i)
    from disagg.llm import LLM

    reply = LLM(engine_dir, compute_dtype="bfloat16").generate(
        ["What is the capital of France? Answer in one word."], SamplingParams(max_tokens=16)
    )
    assert "Paris" in reply[0].text
