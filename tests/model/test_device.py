"""The engine's device-agnostic path. On this machine there is no GPU: what runs here is the
plain-kernel path a CUDA device takes (F.linear instead of oneDNN), on the CPU, checked
against the default path, and the clear refusal of a device that is not there. On a GPU
machine DISAGG_TEST_DEVICE=cuda runs every model test on the device
(deploy/gpu_engine_check.sh)."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.config import EngineConfig
from disagg.engine.kernels import resolve_device
from disagg.engine.llm_engine import DecodeEngine, PrefillEngine
from disagg.engine.model import Llama
from disagg.engine.sequence import SamplingParams
from disagg.errors import ConfigError

pytestmark = pytest.mark.model


def test_the_plain_kernel_path_matches_the_cpu_one(engine_dir, llm, tokenizer):
    from safetensors.torch import load_file

    from disagg.engine.config import WEIGHTS_FILE

    weights = {k: v.float() for k, v in load_file(str(engine_dir / WEIGHTS_FILE)).items()}
    # both fp32 (the served default may be bf16 here: compute_dtype auto)
    ref = Llama(llm.model.args, weights)
    plain = Llama(llm.model.args, weights, onednn=False)
    prompt = tokenizer.encode("The capital of France is")
    a, ka, _ = ref.prefill(prompt)
    b, kb, _ = plain.prefill(prompt)
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-3) and torch.allclose(ka, kb, atol=1e-4)
    # greedy decode with a continuous batch on the plain path: same tokens as the default
    config = EngineConfig(max_num_seqs=4, max_model_len=256)
    eos = {tokenizer.eos_token_id}
    outs = []
    for model in (ref, plain):
        prefill, decode = PrefillEngine(model, config), DecodeEngine(model, config, eos)
        result = prefill.prefill("r", prompt, SamplingParams(max_tokens=12))
        decode.add_request("r", SamplingParams(max_tokens=12), prefill=result)
        decode.add_request("c", SamplingParams(max_tokens=12), prompt_ids=prompt)
        got: dict[str, list[int]] = {"r": [result.first_token], "c": []}
        while decode.has_unfinished:
            for o in decode.step():
                if o.token_id is not None:
                    got[o.request_id].append(o.token_id)
        outs.append(got)
    assert outs[0] == outs[1] and outs[0]["r"] == outs[0]["c"]


def test_a_device_that_is_not_there_is_refused_before_loading(engine_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        Llama.load(engine_dir, device="cuda")
    with pytest.raises(ConfigError, match="cpu or cuda"):
        resolve_device("mps")
    with pytest.raises(ConfigError):
        resolve_device("cuda:x")


def test_fixed_shape_decode_answers_as_the_default_and_is_batch_invariant(engine_dir, llm):
    """The decode a GPU runs (every step padded to all slots and the whole cache length, so
    cuBLAS takes one kernel: engine/model.py `fixed_shapes`), here on the CPU against the
    default decode: the same logits within float error, and a row's bits its own."""
    from safetensors.torch import load_file

    from disagg.engine.config import WEIGHTS_FILE
    from disagg.engine.model import KVCacheSlots

    weights = {k: v.float() for k, v in load_file(str(engine_dir / WEIGHTS_FILE)).items()}
    model = Llama(llm.model.args, weights, onednn=False)  # the plain path a GPU takes
    prompts = [llm.tokenizer.encode(p) for p in ("The capital of France is", "def f(x):", "Hi")]
    cache = KVCacheSlots(model.args, max_slots=4, max_len=64)

    def step(order, fixed):
        model.fixed_shapes = fixed
        for slot, i in enumerate(order):
            cache.write(slot, *model.prefill(prompts[i])[1:])
        pos = torch.tensor([len(prompts[i]) for i in order])
        return model.decode(torch.full((len(order),), 42), pos, cache)

    default = step([0, 1, 2], fixed=False)
    fixed = step([0, 1, 2], fixed=True)
    assert fixed.shape == default.shape
    assert torch.allclose(fixed, default, atol=1e-3, rtol=1e-3)
    for i in range(3):
        assert torch.equal(step([i], fixed=True)[0], fixed[i])
    assert torch.equal(step([2, 0], fixed=True)[1], fixed[0])
    # padding rows wrote nothing: slots past the batch are as the last prefills left them
    before = cache.k[:, 3].clone()
    step([1], fixed=True)
    assert torch.equal(cache.k[:, 3], before)
