"""DecodeService's ordering guarantees, with a scripted engine (no weights): the
acknowledgement is a request's first response and nothing follows its final one. A response
after the final one crashed tritonserver 2.51 (use-after-free of the response factory)."""

from __future__ import annotations

import threading
import time

import pytest

from disagg.contracts import DecodeStats
from disagg.engine import TokenOutput
from disagg.errors import CapacityError
from disagg.pipeline.decode_service import DecodeService
from disagg.sequence import FinishReason, SamplingParams

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

    def send(self, token_ids, finish_reason):
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

    def send(self, token_ids, finish_reason):
        if token_ids or finish_reason is not None:
            raise RuntimeError("the caller died")
        super().send(token_ids, finish_reason)


class BlockingSink(OrderSink):
    """A send that never returns (a response queued for a dead BLS caller in Triton 2.51)."""

    def send(self, token_ids, finish_reason):
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
