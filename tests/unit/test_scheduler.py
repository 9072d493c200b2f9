"""Scheduler behaviour from plain numbers: no weights, no torch."""

import pytest

from disagg.engine.config import EngineConfig
from disagg.engine.scheduler import Scheduler, SlotMove
from disagg.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from disagg.errors import CapacityError, RequestError

pytestmark = pytest.mark.unit

EOS = 2


def seq(rid: str, prompt_len: int = 10, max_tokens: int = 6, **kw) -> Sequence:
    return Sequence(
        rid, prompt_len, [100], SamplingParams(max_tokens=max_tokens, **kw), 0, frozenset({EOS})
    )


def sched(**kw) -> Scheduler:
    return Scheduler(EngineConfig(**{"max_num_seqs": 4, "max_model_len": 64, **kw}))


def test_admits_up_to_max_num_seqs_in_fifo_order():
    s = sched(max_num_seqs=2)
    for i in range(3):
        s.add(seq(f"r{i}"))
    admitted = s.schedule()
    assert [q.request_id for q in admitted] == ["r0", "r1"]
    assert [q.slot for q in s.running] == [0, 1]
    assert [q.request_id for q in s.waiting] == ["r2"]
    assert s.schedule() == []  # still full


def test_kv_budget_holds_back_admission_until_blocks_free():
    # 4 blocks of 16 tokens; each request reserves 10 + 22 = 32 tokens = 2 blocks
    s = sched(num_kv_blocks=4, block_size=16)
    for i in range(3):
        s.add(seq(f"r{i}", max_tokens=22))
    assert [q.request_id for q in s.schedule()] == ["r0", "r1"]
    assert s.block_manager.num_free_blocks == 0
    s.finish(s.running[0], FinishReason.STOP)
    assert [q.request_id for q in s.schedule()] == ["r2"]


def test_fifo_head_blocks_smaller_followers():
    s = sched(num_kv_blocks=5, block_size=16)
    s.add(seq("big", prompt_len=40, max_tokens=20))  # 4 blocks
    s.add(seq("blocked", prompt_len=40, max_tokens=20))  # 4 blocks: does not fit beside big
    s.add(seq("small", prompt_len=4, max_tokens=4))  # 1 block: would fit, but is behind
    assert [q.request_id for q in s.schedule()] == ["big"]
    assert s.block_manager.num_free_blocks == 1
    assert s.schedule() == []
    assert [q.request_id for q in s.waiting] == ["blocked", "small"]


def test_request_that_can_never_fit_is_refused_at_once():
    s = sched(num_kv_blocks=2, block_size=16)
    with pytest.raises(RequestError, match="KV budget"):
        s.add(seq("huge", prompt_len=30, max_tokens=10))
    with pytest.raises(RequestError, match="context limit"):
        sched().add(seq("long", prompt_len=60, max_tokens=10))


def test_full_queue_refuses_with_capacity_error():
    s = sched(max_queue=2)
    s.add(seq("a"))
    s.add(seq("b"))
    with pytest.raises(CapacityError, match="queue full"):
        s.add(seq("c"))


def test_finish_keeps_running_slots_compact():
    s = sched()
    for i in range(4):
        s.add(seq(f"r{i}"))
    s.schedule()
    r1, r3 = s.running[1], s.running[3]
    r3.output_ids += [5, 6]  # r3 has cached prompt + 2 tokens
    move = s.finish(r1, FinishReason.ABORT)
    assert move == SlotMove(src=3, dst=1, num_tokens=r3.num_cached_tokens)
    assert [q.slot for q in s.running] == [0, 1, 2]
    assert s.running[1] is r3 and r1.slot == -1 and r1.finish_reason is FinishReason.ABORT
    assert s.finish(s.running[-1], FinishReason.STOP) is None  # last slot: nothing moves
    assert s.finish(r1, FinishReason.STOP) is None  # already finished: no-op


def test_finish_waiting_sequence_removes_it_from_queue():
    s = sched(max_num_seqs=1)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    s.schedule()
    assert s.finish(b, FinishReason.ABORT) is None
    assert not s.waiting and b.status is SequenceStatus.FINISHED
    assert s.block_manager.num_used_blocks == s.block_manager.blocks_needed(a.max_num_tokens)


def test_stop_reasons():
    s = sched(max_model_len=14)
    q = seq("a", prompt_len=10, max_tokens=3)
    assert s.append_token(q, 7) is None
    assert s.append_token(q, EOS) is FinishReason.STOP
    q = seq("b", prompt_len=10, max_tokens=3, stop_token_ids=(9,))
    assert s.append_token(q, 9) is FinishReason.STOP
    q = seq("c", prompt_len=10, max_tokens=3, ignore_eos=True)
    assert s.append_token(q, EOS) is None
    assert s.append_token(q, EOS) is FinishReason.LENGTH  # 3 output tokens
    q = seq("d", prompt_len=12, max_tokens=2)  # 12 + 2 = context limit of 14
    assert s.append_token(q, 7) is FinishReason.LENGTH


def test_eos_and_stop_tokens_do_not_end_a_sequence_before_min_tokens():
    s = sched()
    q = seq("a", max_tokens=6, min_tokens=3, stop_token_ids=(9,))  # output: [100]
    assert s.append_token(q, EOS) is None and s.append_token(q, 9) is None  # tokens 1, 2
    assert s.append_token(q, EOS) is FinishReason.STOP  # token 3: three came before it


def test_postprocess_appends_every_token_before_anyone_leaves():
    s = sched()
    a, b = seq("a", max_tokens=2), seq("b", max_tokens=6)
    s.add(a)
    s.add(b)
    s.schedule()
    cached_before = b.num_cached_tokens
    done = s.postprocess([a, b], [7, 8])  # a reaches max_tokens and leaves
    assert done == [(a, FinishReason.LENGTH)]
    move = s.finish(a, FinishReason.LENGTH)
    # b's move must include the position this step wrote for it
    assert move == SlotMove(src=1, dst=0, num_tokens=cached_before + 1)
