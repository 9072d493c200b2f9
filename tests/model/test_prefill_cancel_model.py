"""A prefill whose client left stops at its next layer, with the real SmolLM2 engine: it costs
a layer, not the prompt, and leaves nothing behind (the next prefill is bit-identical to one
on a fresh engine; the prefix cache kept none of the cancelled prompt's blocks)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from disagg.engine.config import EngineConfig
from disagg.engine.llm_engine import PrefillEngine
from disagg.engine.sequence import SamplingParams
from disagg.errors import RequestCancelledError

pytestmark = pytest.mark.model
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def prompt(llm, n: int, topic: str) -> list[int]:
    text = " ".join(f"{topic} note {i}: tides, boats and weather." for i in range(120))
    ids = llm.encode(text, chat=False)  # (a chat template's blocks would be shared)
    assert len(ids) >= n
    return ids[:n]


def engine(llm) -> PrefillEngine:
    # as the prefill model builds it (model_repository/prefill/1/model.py)
    return PrefillEngine(llm.model, EngineConfig(max_model_len=2048), reuse_kv_buffers=True)


def asked_times(n: int):
    """A cancel check that says yes from its n-th question on, counting them."""
    asked = []

    def check() -> bool:
        asked.append(time.perf_counter())
        return len(asked) >= n

    return check, asked


def test_a_cancelled_prefill_stops_within_a_layer_and_leaves_nothing_behind(llm):
    long, other = prompt(llm, 600, "harbour"), prompt(llm, 200, "lighthouse")
    layers = llm.model.args.n_layers
    pe = engine(llm)
    start = time.perf_counter()
    pe.prefill("whole", long, GREEDY)
    whole_s = time.perf_counter() - start

    check, asked = asked_times(3)  # asked before layers 0, 1, 2: two layers run
    start = time.perf_counter()
    with pytest.raises(RequestCancelledError):
        pe.prefill("left", prompt(llm, 600, "quay"), GREEDY, is_cancelled=check)
    stopped_s = time.perf_counter() - start
    assert len(asked) == 3
    # two layers of thirty, and the check answered at the third: far under the whole prompt
    assert stopped_s < whole_s * 0.5, (stopped_s, whole_s)

    fresh = engine(llm).prefill("other", other, GREEDY)
    after = pe.prefill("other", other, GREEDY)
    assert after.first_token == fresh.first_token
    assert np.array_equal(after.kv.k, fresh.kv.k) and np.array_equal(after.kv.v, fresh.kv.v)
    # the cancelled prompt left no blocks: it starts fresh, unlike the finished one
    assert pe.kv_reuse is not None
    again = pe.prefill("quay", prompt(llm, 600, "quay"), GREEDY)
    assert again.num_reused_tokens == 0
    assert pe.prefill("whole-again", long, GREEDY).num_reused_tokens > 0
    assert layers == 30  # (SmolLM2-135M: what "a layer" above is a thirtieth of)


def test_a_prefill_after_a_cached_prefix_is_cancellable_too(llm):
    pe = engine(llm)
    base = prompt(llm, 800, "pier")
    pe.prefill("first", base[:256], GREEDY)  # its blocks are cached
    check, asked = asked_times(1)
    with pytest.raises(RequestCancelledError):
        pe.prefill("rest", base, GREEDY, is_cancelled=check)  # 256 cached, 544 to compute
    assert len(asked) == 1
    uncancelled = pe.prefill("rest", base, GREEDY, is_cancelled=lambda: False)
    assert uncancelled.num_reused_tokens == 256
