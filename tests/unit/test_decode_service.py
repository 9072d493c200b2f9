"""DecodeService's ordering guarantees, with a scripted engine (no weights): the
acknowledgement is a request's first response and nothing follows its final one. A response
after the final one crashed tritonserver 2.51 (use-after-free of the response factory)."""

from __future__ import annotations

import threading
import time

import pytest

from disagg.contracts import DecodeStats
from disagg.engine.llm_engine import TokenOutput
from disagg.engine.sequence import FinishReason, SamplingParams
from disagg.errors import CapacityError
from disagg.pipeline.decode_service import DecodeService

pytestmark = pytest.mark.unit


class InstantEngine:
    """Finishes every request at the first step after it was added (max_tokens=1-like)."""

    def __init__(self, capacity: int = 1000) -> None:
        self.pending: list[str] = []
        self.lock = threading.Lock()
        self.capacity = capacity

    @property
    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def add_request(self, rid, params, prefill=None, prompt_ids=None):
        with self.lock:
            if len(self.pending) >= self.capacity:
                raise CapacityError("full")
            self.pending.append(rid)

    def finish_request(self, rid, reason=FinishReason.ABORT):
        pass

    def step(self):
        with self.lock:
            done, self.pending = self.pending, []
        return [TokenOutput(r, 7, 1, FinishReason.LENGTH) for r in done]

    def stats(self):
        return DecodeStats(num_running=len(self.pending), num_waiting=0)


class OrderSink:
    def __init__(self) -> None:
        self.events: list[tuple[list[int], str | None]] = []
        self.done = threading.Event()
        self.lock = threading.Lock()

    def send(self, token_ids, finish_reason, num_cached_tokens=0, logprobs=None):
        if not token_ids and finish_reason is None:
            time.sleep(0.002)  # a slow acknowledgement (a busy stub): the loop must still wait
        with self.lock:
            self.events.append((list(token_ids), finish_reason))
        if finish_reason is not None:
            self.done.set()

    def fail(self, error):
        self.done.set()

    def is_cancelled(self):
        return False


def test_the_acknowledgement_always_comes_first_and_nothing_after_the_final():
    service = DecodeService(InstantEngine()).start()
    try:
        sinks = []
        for i in range(100):
            sink = OrderSink()
            service.submit(f"r{i}", SamplingParams(max_tokens=1), sink, prompt_ids=[1])
            sinks.append(sink)
        for sink in sinks:
            assert sink.done.wait(5)
            assert sink.events == [([], None), ([7], "length")]
    finally:
        service.stop()


def test_before_step_runs_on_the_loop_thread_before_every_step():
    engine, calls = InstantEngine(), []
    stepped = engine.step

    def step():
        calls.append(("step", threading.current_thread().name))
        return stepped()

    engine.step = step
    before = lambda: calls.append(("before", threading.current_thread().name))  # noqa: E731
    service = DecodeService(engine, before_step=before).start()
    try:
        for i in range(3):
            sink = OrderSink()
            service.submit(f"r{i}", SamplingParams(max_tokens=1), sink, prompt_ids=[1])
            assert sink.done.wait(5)
    finally:
        service.stop()
    assert calls and len(calls) % 2 == 0
    assert calls[0::2] == [("before", "decode-loop")] * (len(calls) // 2)
    assert calls[1::2] == [("step", "decode-loop")] * (len(calls) // 2)


def test_a_refused_request_was_acknowledged_then_raises():
    service = DecodeService(InstantEngine(capacity=0)).start()
    try:
        sink = OrderSink()
        with pytest.raises(CapacityError):
            service.submit("r", SamplingParams(max_tokens=1), sink, prompt_ids=[1])
        assert sink.events == [([], None)]  # the model then sends the error as the final one
    finally:
        service.stop()


class CallerGoneSink(OrderSink):
    """A request whose caller died after the acknowledgement: every later send refuses."""

    def send(self, token_ids, finish_reason, num_cached_tokens=0, logprobs=None):
        if token_ids or finish_reason is not None:
            raise RuntimeError("the caller died")
        super().send(token_ids, finish_reason)


class BlockingSink(OrderSink):
    """A send that never returns (a response queued for a dead BLS caller in Triton 2.51)."""

    def send(self, token_ids, finish_reason, num_cached_tokens=0, logprobs=None):
        if token_ids or finish_reason is not None:
            threading.Event().wait()
        super().send(token_ids, finish_reason)


def test_a_request_whose_caller_died_is_finished_and_the_others_are_served():
    engine = InstantEngine()
    finished = []
    engine.finish_request = lambda rid, reason=FinishReason.ABORT: finished.append(rid)
    service = DecodeService(engine).start()
    try:
        gone, alive = CallerGoneSink(), OrderSink()
        service.submit("gone", SamplingParams(max_tokens=1), gone, prompt_ids=[1])
        service.submit("alive", SamplingParams(max_tokens=1), alive, prompt_ids=[1])
        assert alive.done.wait(5) and alive.events == [([], None), ([7], "length")]
        assert finished == ["gone"]
    finally:
        service.stop()


def test_a_send_that_never_returns_trips_the_watchdog():
    stuck = threading.Event()
    service = DecodeService(
        InstantEngine(), stuck_send_s=0.3, on_stuck=lambda s: stuck.set()
    ).start()
    service.submit("r", SamplingParams(max_tokens=1), BlockingSink(), prompt_ids=[1])
    assert stuck.wait(5)  # in production: the process exits and the supervisor restarts it


class CountingEngine:
    """Each request makes one token per step until it has `max_tokens`; `running` is what
    stats() reports (the load the stream interval looks at)."""

    def __init__(self, running: int) -> None:
        self.left: dict[str, int] = {}
        self.made: dict[str, int] = {}
        self.lock = threading.Lock()
        self.running = running

    @property
    def has_unfinished(self) -> bool:
        return bool(self.left)

    def add_request(self, rid, params, prefill=None, prompt_ids=None):
        with self.lock:
            self.left[rid], self.made[rid] = params.max_tokens, 0

    def finish_request(self, rid, reason=FinishReason.ABORT):
        pass

    def step(self):
        out = []
        with self.lock:
            for rid in list(self.left):
                self.left[rid] -= 1
                self.made[rid] += 1
                done = FinishReason.LENGTH if self.left[rid] == 0 else None
                out.append(TokenOutput(rid, 100 + self.made[rid], self.made[rid] - 1, done))
                if done:
                    del self.left[rid]
        return out

    def stats(self):
        return DecodeStats(num_running=self.running, num_waiting=0)


@pytest.mark.parametrize(
    "running, want",
    [
        # over half of 8 slots busy: first token at once, then 3 per response, the rest final
        (5, [[101], [102, 103, 104], [105, 106, 107], [108, 109, 110]]),
        (4, [[101], [102], [103], [104], [105], [106], [107], [108], [109], [110]]),  # light
    ],
)
def test_under_load_several_tokens_go_out_per_response_none_lost(running, want):
    engine = CountingEngine(running)
    service = DecodeService(engine, stream_interval=3, batch_slots=8)  # driven by hand
    sink = OrderSink()
    service.submit("r", SamplingParams(max_tokens=10), sink, prompt_ids=[1])
    while engine.has_unfinished:
        service._deliver(engine.step(), engine.running)
    assert sink.events[0] == ([], None)  # the acknowledgement
    assert [tokens for tokens, _ in sink.events[1:]] == want
    assert [f for _, f in sink.events[1:]] == [None] * (len(want) - 1) + ["length"]


class GateSink(OrderSink):
    """The first token's send waits until the test opens the gate (a busy tritonserver)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def send(self, token_ids, finish_reason, num_cached_tokens=0, logprobs=None):
        if token_ids[:1] == [101]:
            assert self.gate.wait(5)
        super().send(token_ids, finish_reason)


def test_the_loop_steps_on_while_a_send_waits_and_waiting_tokens_go_out_together():
    engine = CountingEngine(running=1)  # light load: without waiting, one token a response
    service = DecodeService(engine, stream_interval=3, batch_slots=8).start()
    try:
        sink = GateSink()
        service.submit("r", SamplingParams(max_tokens=10), sink, prompt_ids=[1])
        deadline = time.monotonic() + 5
        while engine.has_unfinished and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not engine.has_unfinished  # every step ran while the first send was stuck
        assert sink.events == [([], None)]
        sink.gate.set()
        assert sink.done.wait(5)
        got = sink.events[1:]
        assert [t for tokens, _ in got for t in tokens] == list(range(101, 111))
        assert [f for _, f in got] == [None] * (len(got) - 1) + ["length"]
        assert len(got) <= 2  # what waited behind the stuck send went out in one
    finally:
        service.stop()


def test_held_tokens_go_out_when_the_load_drops():
    engine = CountingEngine(running=8)
    service = DecodeService(engine, stream_interval=4, batch_slots=8)
    sink = OrderSink()
    service.submit("r", SamplingParams(max_tokens=10), sink, prompt_ids=[1])
    for _ in range(3):  # driven by hand: first token, then two held
        service._deliver(engine.step(), engine.running)
    assert [t for t, _ in sink.events[1:]] == [[101]]
    engine.running = 2
    service._deliver(engine.step(), engine.running)
    assert [t for t, _ in sink.events[1:]] == [[101], [102, 103, 104]]


def test_waiting_responses_merge_per_request_in_order_never_past_a_final_or_a_failure():
    from disagg.pipeline.decode_service import _coalesce, _Send

    a, b = OrderSink(), OrderSink()
    boom = RuntimeError("engine died")
    sends = [
        _Send("a", a, [1], num_cached_tokens=5),
        _Send("b", b, [7]),
        _Send("a", a, [2, 3]),
        _Send("b", b, [8], "stop"),
        _Send("b", b, [9]),  # (none comes after a final; if one did, it stays apart)
        _Send("a", a, error=boom),
        _Send("a", a, [4]),
    ]
    got = [(s.rid, s.tokens, s.finish, s.num_cached_tokens, s.error) for s in _coalesce(sends)]
    assert got == [
        ("a", [1, 2, 3], None, 5, None),
        ("b", [7, 8], "stop", 0, None),
        ("b", [9], None, 0, None),
        ("a", [], None, 0, boom),
        ("a", [4], None, 0, None),
    ]
