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
