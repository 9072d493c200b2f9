"""The simulator's decode engine (planner/decode_sim.py) mirrors the real one's step: the
real DecodeEngine, over a model that computes nothing and a Recorder that writes down its
calls, and SimDecodeEngine get the same requests at the same steps; every step must run the
same work (prefills, chunks, decode rows and positions, K/V writes and moves) and give the
same outputs. A change to DecodeEngine.step that decode_sim.py does not copy fails here."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from disagg.engine.config import EngineConfig, ModelArgs
from disagg.engine.kv_payload import KVPayload
from disagg.engine.llm_engine import DecodeEngine, PrefillResult
from disagg.engine.sequence import SamplingParams
from disagg.planner.decode_sim import (
    CHUNK,
    DECODE,
    KV_MOVE,
    PREFILL,
    SIM_TOKEN,
    SimDecodeEngine,
    SimHandoff,
)
from disagg.planner.recording import Recorder

pytestmark = pytest.mark.unit
ARGS = ModelArgs(
    dim=4, n_layers=1, n_heads=1, n_kv_heads=1, hidden_dim=4, vocab_size=8, max_context=512
)


class NoModel:
    """What DecodeEngine calls of a Llama, computing nothing; greedy sampling picks
    SIM_TOKEN from its logits, as the simulator's engine samples."""

    args = ARGS
    device = torch.device("cpu")
    compute_dtype = "float32"
    blocks: dict[str, object] = {}  # no quantized weights

    def _logits(self, rows: int | None = None) -> torch.Tensor:
        one = torch.zeros(ARGS.vocab_size)
        one[SIM_TOKEN] = 1.0
        return one if rows is None else one.repeat(rows, 1)

    def prefill(self, token_ids, all_logits=False, kv_out=None):
        k = torch.zeros(ARGS.n_layers, ARGS.n_kv_heads, len(token_ids), ARGS.head_dim)
        return self._logits(), k, k.clone()

    def prefill_chunk(self, token_ids, start, cache, slot):
        return self._logits()

    def prefill_chunks(self, chunks, cache):
        return [self._logits() for _ in chunks]

    def decode(self, tokens, positions, cache):
        return self._logits(len(tokens))


def imported(rid: str, n: int) -> PrefillResult:
    k = np.zeros((ARGS.n_layers, ARGS.n_kv_heads, n, ARGS.head_dim), np.float32)
    return PrefillResult(rid, SIM_TOKEN, KVPayload.from_arrays(ARGS, k, k.copy()), 0, 0.0)


class Pair:
    """The real engine and the mirror, fed alike."""

    def __init__(self, config: EngineConfig) -> None:
        self.real = DecodeEngine(NoModel(), config, eos_token_ids=set())
        self.recorder = Recorder(self.real)
        self.sim = SimDecodeEngine(config)
        self.kinds: set[str] = set()

    def add(self, rid: str, prompt_len: int, max_tokens: int, with_kv: bool) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if with_kv:
            self.real.add_request(rid, params, prefill=imported(rid, prompt_len))
            self.sim.add_request(rid, params, prefill=SimHandoff(prompt_len))
        else:
            self.real.add_request(rid, params, prompt_ids=[0] * prompt_len)
            self.sim.add_request(rid, params, prompt_ids=[0] * prompt_len)

    def step(self) -> None:
        real_out = self.real.step()
        sim_work, sim_out = self.sim.step()
        real_work = self.recorder.take()
        assert sim_work.ops == real_work.ops
        fields = ("request_id", "token_id", "index", "finish_reason")
        assert [tuple(getattr(o, f) for f in fields) for o in sim_out] == [
            tuple(getattr(o, f) for f in fields) for o in real_out
        ]
        self.kinds |= {k for k, _, _ in real_work.ops}

    @property
    def busy(self) -> bool:
        assert self.real.has_unfinished == self.sim.has_unfinished
        return self.real.has_unfinished


def run_script(pair: Pair, script: dict[int, list[tuple[str, int, int, bool]]]) -> None:
    step = 0
    while step <= max(script) or pair.busy:
        for rid, n, out, with_kv in script.get(step, []):
            pair.add(rid, n, out, with_kv)
        pair.step()
        step += 1
        assert step < 5000


def test_a_burst_of_prompts_is_prefilled_whole_within_the_burst_cap():
    pair = Pair(EngineConfig(max_num_seqs=8, max_model_len=512, prefill_chunk_tokens=16,
                             burst_prefill_tokens=120, prefix_cache_tokens=0))  # fmt: skip
    run_script(pair, {0: [(f"b{i}", n, 5, False) for i, n in enumerate((10, 40, 100, 20, 70))]})
    assert PREFILL in pair.kinds and DECODE in pair.kinds


def test_a_long_prompt_is_chunked_beside_a_decoding_batch():
    pair = Pair(EngineConfig(max_num_seqs=4, max_model_len=512, prefill_chunk_tokens=16,
                             prefix_cache_tokens=0))  # fmt: skip
    run_script(pair, {
        0: [("kv0", 30, 40, True), ("kv1", 50, 1, True)],  # kv1 ends at admission
        2: [("long", 200, 3, False)],
        3: [("short", 8, 1, False), ("kv2", 10, 5, True)],
        4: [("kv3", 12, 6, True), ("kv4", 14, 2, True)],  # the batch is full: they wait
    })  # fmt: skip
    assert {CHUNK, KV_MOVE} <= pair.kinds


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_run_the_same_steps(seed):
    rng = random.Random(seed)
    config = EngineConfig(
        max_num_seqs=rng.choice((2, 4, 8)), max_model_len=512,
        prefill_chunk_tokens=rng.choice((16, 32, 64)),
        burst_prefill_tokens=rng.choice((64, 256, 2048)),
        num_kv_blocks=rng.choice((0, 40)), block_size=16, prefix_cache_tokens=0,
    )  # fmt: skip
    script: dict[int, list[tuple[str, int, int, bool]]] = {}
    for i in range(40):
        at = rng.randrange(0, 150)
        n, out = rng.choice((1, 8, 60, 150, 300)), rng.choice((1, 2, 16, 60))
        script.setdefault(at, []).append((f"r{i}", n, out, rng.random() < 0.5))
    run_script(Pair(config), script)
