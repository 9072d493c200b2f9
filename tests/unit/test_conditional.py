"""The conditional mode's cost model on crafted cases: each decision follows the documented
formula, names the documented reason, and learns from what the pools report."""

from __future__ import annotations

import pytest

from disagg.pipeline.conditional import (
    DECODE_IDLE,
    PREFILL_QUEUE,
    PREFIX_CACHED,
    PROTECT_DECODE,
    SHORT_PROMPT,
    CostModel,
    CostParams,
    Load,
    LoadTracker,
)

pytestmark = pytest.mark.unit

# round numbers: 1 ms per prompt token, 10 ms fixed hand-off, 10 us per token hand-off
PARAMS = CostParams(
    prefill_s_per_token=1e-3, handoff_fixed_s=0.010, handoff_s_per_token=1e-5, remote_stall=0.5
)


def decide(tokens: int, queue_tokens: int = 0, active: int = 0, **params):
    model = CostModel(CostParams(**{**PARAMS.__dict__, **params}))
    return model.decide(tokens, Load(queue_tokens, active))


def test_each_side_prefills_only_what_its_prefix_cache_lacks():
    model = CostModel(PARAMS)
    # 1000 tokens, 4 decoding: remote without caches (see the next tests), but decode holds
    # 900 of them: local = 0.1 s x 5 = 0.5 s; remote = 1 + 0.011 + 4 x 1 x 0.5 = 3.011 s (the
    # hand-off moves only the 100 tokens decode lacks: 10 ms + 100 x 10 us)
    d = model.decide(1000, Load(0, 4), cached_local=900)
    assert (d.remote, d.reason) == (False, PREFIX_CACHED)
    assert d.local_cost_s == pytest.approx(0.5) and d.remote_cost_s == pytest.approx(3.011)
    assert d.handoff_s == pytest.approx(0.011)
    # the prefill pool holds them instead: remote = 0.1 + 0.02 + 4 x 0.1 x 0.5 = 0.32 s
    d = model.decide(1000, Load(0, 4), cached_remote=900)
    assert d.remote and d.remote_cost_s == pytest.approx(0.32)


def test_idle_decode_always_prefills_locally():
    d = decide(2000, active=0)
    assert (d.remote, d.reason) == (False, DECODE_IDLE)
    # local = P = 2 s; remote = P + H = 2 s + 10 ms + 20 ms
    assert d.local_cost_s == pytest.approx(2.0)
    assert d.remote_cost_s == pytest.approx(2.0 + 0.010 + 0.020)


def test_long_prompt_with_running_sequences_goes_remote():
    d = decide(1000, active=4)
    # local = P (1 + 4) = 5 s; remote = 1 + 0.02 + 4 * 1 * 0.5 = 3.02 s
    assert (d.remote, d.reason) == (True, PROTECT_DECODE)
    assert d.local_cost_s == pytest.approx(5.0)
    assert d.remote_cost_s == pytest.approx(3.02)
    assert "remote (protect_decode)" in d.explain()


def test_short_prompt_stays_local_because_the_hand_off_costs_more_than_the_stall():
    d = decide(8, active=1)
    # local = 8 ms * 2 = 16 ms; remote = 8 + 10.08 + 4 = 22.08 ms
    assert (d.remote, d.reason) == (False, SHORT_PROMPT)
    assert d.local_cost_s == pytest.approx(0.016)
    assert d.remote_cost_s == pytest.approx(0.02208)


def test_a_deep_prefill_queue_keeps_even_a_long_prompt_local():
    d = decide(500, queue_tokens=4000, active=2)
    # local = 0.5 * 3 = 1.5 s; remote = 4 + 0.5 + 0.015 + 0.5 = 5.015 s
    assert (d.remote, d.reason) == (False, PREFILL_QUEUE)
    assert d.queue_s == pytest.approx(4.0)


def test_more_prefill_instances_drain_the_queue_faster():
    assert decide(500, queue_tokens=4000, active=2).remote is False
    # 8 instances: queue 0.5 s, remote 1.515 s vs local 1.5 s; 16: queue 0.25 s, remote 1.265 s
    assert decide(500, queue_tokens=4000, active=2, prefill_instances=8).remote is False
    assert decide(500, queue_tokens=4000, active=2, prefill_instances=16).remote is True


def test_separate_hardware_makes_remote_cheaper_sooner():
    # with a 32-token prompt and one running sequence: local 64 ms
    shared = decide(32, active=1, remote_stall=1.0)  # remote 32 + 10.3 + 32 ms: local wins
    separate = decide(32, active=1, remote_stall=0.0)  # remote 32 + 10.3 ms: remote wins
    assert (shared.remote, separate.remote) == (False, True)


def test_the_crossover_prompt_length_matches_the_formula():
    # with A running sequences, remote wins once P * A * (1 - stall) > H
    # A = 1, stall 0.5: 0.5 ms/token * L > 10 ms + 0.01 ms * L  ->  L > 20.4
    assert decide(20, active=1).remote is False
    assert decide(21, active=1).remote is True


def test_ties_go_local():
    model = CostModel(
        CostParams(prefill_s_per_token=0.0, handoff_fixed_s=0.0, handoff_s_per_token=0.0)
    )
    assert model.decide(100, Load(0, 3)).remote is False


def test_it_learns_prefill_and_hand_off_speed_from_reports():
    model = CostModel(
        CostParams(prefill_s_per_token=1e-3, handoff_s_per_token=1e-5, learn_rate=0.5)
    )
    model.observe_prefill(1000, 3.0)  # the pool reports 3 ms per token
    assert model.remote_s_per_token == pytest.approx(2e-3)  # halfway there
    assert model.local_s_per_token == pytest.approx(1e-3)  # decode's own speed: not this
    # decode's first long prefill beside others: learned from the pool's 2 ms that decisions
    # assumed until now (not from the 1 ms prior), halfway to the 0.5 ms seen
    model.observe_local_prefill(1000, 0.5)
    assert model.local_s_per_token == pytest.approx(1.25e-3)
    model.observe_local_prefill(10, 5.0)  # a short prompt: mostly waiting for a step
    assert model.local_s_per_token == pytest.approx(1.25e-3)
    assert model.local_fixed_s == pytest.approx((5.0 - 10 * 1.25e-3) / 2)  # its fixed cost
    model.observe_handoff(1000, 0.005 + 0.05)  # 50 us per token over the fixed 5 ms
    assert model.handoff_s_per_token == pytest.approx((1e-5 + 5e-5) / 2)
    model.observe_prefill(0, 1.0)  # nothing to learn from an empty prompt
    assert model.remote_s_per_token == pytest.approx(2e-3)
    # what the metrics show (disagg_conditional_estimate) is what it now decides with
    assert model.estimates() == pytest.approx({
        "remote_stall": 0.5, "local_prefill_s_per_token": 1.25e-3,
        "remote_prefill_s_per_token": 2e-3, "local_prefill_fixed_s": model.local_fixed_s,
        "remote_prefill_fixed_s": 0.0, "handoff_s_per_token": (1e-5 + 5e-5) / 2,
    })  # fmt: skip


def test_until_decode_learned_its_speed_the_estimates_show_the_pools():
    """Before decode prefilled a long prompt beside others, decisions take its speed as the
    prefill pool's: the estimate shown must be that one, not the unused prior."""
    model = CostModel(CostParams(prefill_s_per_token=1e-3, learn_rate=1.0))
    model.observe_prefill(1000, 4.0)
    assert model.estimates()["local_prefill_s_per_token"] == pytest.approx(4e-3)


def test_shared_cores_keep_prefill_local_separate_hardware_sends_it_away():
    # shared cores: the pool gets half of them, so it prefills at half speed and decode runs
    # at half speed meanwhile (stall 0.5): the decoders lose the same time either way
    shared = CostModel(CostParams(prefill_s_per_token=1e-3, remote_stall=0.5, learn_rate=1.0))
    shared.observe_prefill(1000, 2.0)
    shared.observe_local_prefill(1000, 1.0, beside=4)  # decode prefilled one beside others
    d = shared.decide(2000, Load(0, 4))
    # local 2 x 5 = 10 s; remote 4 + 0.045 + 4 x 4 x 0.5 = 12.045 s
    assert (d.remote, d.local_cost_s, d.remote_cost_s) == (False, 10.0, pytest.approx(12.045))
    # separate GPUs: the pool prefills as fast as decode would, and decode does not slow down
    separate = CostModel(CostParams(prefill_s_per_token=1e-3, remote_stall=0.0))
    assert separate.decide(2000, Load(0, 4)).remote is True


def test_invalid_parameters_are_refused():
    with pytest.raises(ValueError):
        CostModel(CostParams(remote_stall=1.5))
    with pytest.raises(ValueError):
        CostModel(CostParams(prefill_instances=0))


def test_load_tracker_reports_changes():
    seen = []
    tracker = LoadTracker(on_change=seen.append)
    tracker.add_prefill(100)
    tracker.add_decode(2)
    tracker.add_prefill(-100)
    assert tracker.snapshot() == Load(0, 2)
    assert [load.prefill_queue_tokens for load in seen] == [100, 0]


def test_remote_stall_is_learned_from_token_gaps():
    model = CostModel(CostParams(remote_stall=0.5, min_gaps=16))
    for _ in range(16):
        model.observe_gap(0.040, remote_prefill_running=False)
    assert model.remote_stall == 0.5  # no busy gaps yet: the prior holds
    for _ in range(16):
        model.observe_gap(0.160, remote_prefill_running=True)  # 4x slower while it prefills
    assert model.remote_stall == pytest.approx(0.75)  # 1 - 40/160
    model.observe_gap(5.0, remote_prefill_running=False)  # one co-located prefill's stall
    assert model.remote_stall == pytest.approx(0.75)  # medians ignore it


def test_a_learned_full_stall_keeps_prefill_local():
    # shared cores that a remote prefill slows as much as a local one: nothing to gain remotely
    model = CostModel(CostParams(prefill_s_per_token=1e-3, min_gaps=8))
    for busy, gap in ((False, 0.04), (True, 40.0)):
        for _ in range(8):
            model.observe_gap(gap, busy)
    assert model.remote_stall == pytest.approx(0.999)
    # local 2 s x 9 = 18 s; remote 2 + 0.045 + 8 x 2 x 0.999 = 18.03 s
    assert model.decide(2000, Load(0, 8)).remote is False


def test_short_prompts_teach_the_fixed_cost_long_ones_the_cost_per_token():
    # the failing rhythm round of 2026-12-06: one 64-token stream prompt went to the pool and
    # took 166 ms; counted per token (2.6 ms) it kept three 1,600-token prompts local
    model = CostModel(CostParams(prefill_s_per_token=1.5e-3, learn_rate=1.0))
    model.observe_prefill(64, 0.166)
    assert model.remote_s_per_token == pytest.approx(1.5e-3)
    assert model.remote_fixed_s == pytest.approx(0.166 - 64 * 1.5e-3)
    d = model.decide(1600, Load(0, 4))
    assert d.remote and d.remote_prefill_s == pytest.approx(0.07 + 2.4)
    model.observe_prefill(1600, 8.07)  # a long one: the per-token cost, less the fixed
    assert model.remote_s_per_token == pytest.approx(8.0 / 1600)
    assert model.remote_fixed_s == pytest.approx(0.07)


def test_until_decode_prefilled_a_long_prompt_beside_others_it_is_taken_as_fast_as_the_pool():
    model = CostModel(CostParams(prefill_s_per_token=1.5e-3, remote_stall=0.2, learn_rate=1.0))
    model.observe_prefill(1600, 8.0)  # the pool: 5 ms a token (one thread at nice 10)
    d = model.decide(1600, Load(0, 4))
    # not the 1.5 ms prior: local 8 x 5 = 40 s; remote 8 + 0.037 + 4 x 8 x 0.2 = 14.437 s
    assert d.local_prefill_s == pytest.approx(8.0) and d.remote and d.local_cost_s == 40.0
    model.observe_local_prefill(1600, 1.6, beside=0)  # decode idle: runs at a speed not needed
    assert model.decide(1600, Load(0, 4)).local_prefill_s == pytest.approx(8.0)
    model.observe_local_prefill(1600, 1.6, beside=4)  # beside four: 1 ms a token, learned
    d = model.decide(1600, Load(0, 4))
    assert d.local_prefill_s == pytest.approx(1.6) and not d.remote


def test_a_fixed_cost_holds_up_its_own_request_and_each_queued_one_not_the_decoders():
    model = CostModel(CostParams(prefill_s_per_token=1e-3, remote_stall=0.5, learn_rate=1.0))
    model.observe_local_prefill(100, 1.1, beside=3)  # 1 s of waiting for steps, 0.1 s compute
    model.observe_prefill(100, 0.6)  # the pool: 0.5 s of call and queueing, 0.1 s compute
    d = model.decide(100, Load(300, 10, prefill_queue_requests=3))
    # local = 1.1 + 10 x 0.1 = 2.1 s (not 1.1 x 11); the three queued prompts cost their
    # tokens and their fixed costs: Q = 0.3 + 3 x 0.5 = 1.8 s;
    # remote = 1.8 + 0.6 + (0.005 + 100 x 2e-5) + 10 x 0.1 x 0.5 = 2.907 s
    assert d.local_cost_s == pytest.approx(2.1) and d.queue_s == pytest.approx(1.8)
    assert d.remote_cost_s == pytest.approx(2.907) and not d.remote


def test_the_tracker_counts_queued_prompts_with_their_tokens():
    tracker = LoadTracker()
    tracker.add_prefill(700)
    tracker.add_prefill(64)
    assert tracker.snapshot() == Load(764, 0, prefill_queue_requests=2)
    tracker.add_prefill(-700)
    assert tracker.snapshot() == Load(64, 0, prefill_queue_requests=1)


def test_decodes_first_long_prefill_moves_the_estimate_from_the_pools_speed_not_the_prior():
    # the default learn rate: a pool at 5 ms a token and decode seen at 5 ms too must not
    # make decode look 2.3x cheaper (0.8 x the 1.5 ms prior + 0.2 x 5 ms = 2.2 ms)
    model = CostModel(CostParams(prefill_s_per_token=1.5e-3))
    for _ in range(30):
        model.observe_prefill(1600, 8.0)
    model.observe_local_prefill(1600, 8.0, beside=4)
    d = model.decide(1600, Load(0, 4))
    assert d.local_prefill_s == pytest.approx(d.remote_prefill_s, rel=0.01)


def test_prompts_decode_is_prefilling_are_a_queue_for_the_next_local_one():
    """Sixteen prompts arriving together, all prefilled by decode: the next one would wait
    for them locally as it would for the pool's queue remotely."""
    model = CostModel(CostParams(prefill_s_per_token=1e-3, remote_stall=0.0))
    alone = model.decide(150, Load(0, 2))
    queued = model.decide(150, Load(0, 2, local_queue_tokens=15 * 150))
    assert queued.local_cost_s == pytest.approx(alone.local_cost_s + 15 * 150 * 1e-3)
    assert queued.remote_cost_s == pytest.approx(alone.remote_cost_s)


def test_waiting_behind_other_local_prompts_is_not_learned_as_a_fixed_cost():
    """The 8th prompt of a burst took 1.2 s to its first token, 1.05 s of it behind 7 others:
    what is left is this prompt's own, and only that teaches the fixed cost."""
    model = CostModel(CostParams(prefill_s_per_token=1e-3, learn_rate=1.0))
    model.observe_local_prefill(150, 1.2, beside=3, ahead_tokens=7 * 150)
    assert model.local_fixed_s == pytest.approx(1.2 - 7 * 150e-3 - 150e-3)
    blind = CostModel(CostParams(prefill_s_per_token=1e-3, learn_rate=1.0))
    blind.observe_local_prefill(150, 1.2, beside=3)
    assert blind.local_fixed_s > 5 * model.local_fixed_s


def test_the_tracker_counts_local_prefills_until_their_first_token():
    tracker = LoadTracker()
    first = tracker.local_prefill(100)
    with tracker.local_prefill(50) as second:
        assert second.ahead == 100 and tracker.snapshot().local_queue_tokens == 150
        second.done()
        assert tracker.snapshot().local_queue_tokens == 100
    first.done()
    first.done()  # idempotent: the stream's end after its first token takes nothing twice
    assert tracker.snapshot().local_queue_tokens == 0
    with pytest.raises(RuntimeError), tracker.local_prefill(70):
        raise RuntimeError("decode failed before the first token")
    assert tracker.snapshot().local_queue_tokens == 0
