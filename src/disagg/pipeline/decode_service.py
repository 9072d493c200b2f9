"""The decode model's engine loop: one thread steps the DecodeEngine while Triton's execute()
adds requests from another. No Triton here; responses leave through a `Sink` per request."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from disagg.cancel import CancelRegistry
from disagg.contracts import DecodeStats
from disagg.engine.sequence import FinishReason, SamplingParams
from disagg.errors import EngineDeadError

if TYPE_CHECKING:  # the engine brings torch; this loop needs only its interface
    from disagg.engine.llm_engine import DecodeEngine, PrefillResult, TokenOutput
    from disagg.engine.sequence import TokenLogprob

log = logging.getLogger("disagg.decode")


class Sink(Protocol):
    """Where one request's decode output goes (a Triton response sender, in production)."""

    def send(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        num_cached_tokens: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """`num_cached_tokens`: with the first token of a prompt decode prefilled, the
        prompt tokens its prefix cache gave. `logprobs`: one per token, when the request
        asks for them."""
        ...

    def fail(self, error: Exception) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass(eq=False)
class _Stream:
    """One request's way out of decode: its sink and the tokens it has not been sent yet."""

    sink: Sink
    held: list[int] = field(default_factory=list)  # waiting for the next response (load)
    held_logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, if asked for
    started: bool = False  # its first token went out
    num_cached_tokens: int = 0  # goes out with the first token

    def hold(self, tokens: list[int], logprobs: list[TokenLogprob]) -> None:
        self.held += tokens
        self.held_logprobs += logprobs

    def take(
        self, tokens: list[int], logprobs: list[TokenLogprob]
    ) -> tuple[list[int], list[TokenLogprob]]:
        """The held tokens and `tokens` (and their logprobs), now to be sent; nothing is
        held after."""
        out = self.held + tokens, self.held_logprobs + logprobs
        self.held, self.held_logprobs = [], []
        return out


@dataclass(eq=False)
class _Send:
    """One response due to a request's sink: tokens (their logprobs, if asked for), or the
    failure of the engine instead (`error`)."""

    rid: str
    sink: Sink
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: Exception | None = None

    def absorb(self, later: _Send) -> bool:
        """Take a later response of the same request into this one if both carry tokens
        and this one is not the final one: one send instead of two, order kept."""
        if self.error is not None or later.error is not None or self.finish is not None:
            return False
        self.tokens += later.tokens
        self.logprobs += later.logprobs
        self.finish = later.finish
        self.num_cached_tokens = self.num_cached_tokens or later.num_cached_tokens
        return True


def _coalesce(sends: list[_Send]) -> list[_Send]:
    """Each request's responses waiting together as few sends as its order allows."""
    out: list[_Send] = []
    last: dict[str, _Send] = {}
    for send in sends:
        prev = last.get(send.rid)
        if prev is None or not prev.absorb(send):
            out.append(send)
            last[send.rid] = send
    return out


def _exit_process(stuck_s: float) -> None:
    log.critical("a response send has been stuck for %.0f s: exiting for a restart", stuck_s)
    os._exit(70)


class DecodeService:
    """Steps the engine and delivers its output.

    Delivery has a thread of its own: a Triton send is a round trip to tritonserver (it
    waits for the server to take the response), ~1 ms each on two busy cores, and 16 of
    them a step had the engine idle for 14% of a served run. The loop hands each step's
    responses over and steps on; responses of one request that wait together go out as one
    (under load, fewer sends), in order. The same thread asks the senders about cancels.

    One send that never returns would stop every request of this instance: Triton 2.51 hands
    a response to a BLS caller that died to its dead process, and the send can block for
    good. Sinks refuse to send to a dead caller; as the backstop, a watchdog calls `on_stuck`
    (default: exit the process, so the supervisor restarts the model and every caller sees
    the death at once) when delivering has taken longer than `stuck_send_s`."""

    def __init__(
        self,
        engine: DecodeEngine,
        cancels: CancelRegistry | None = None,
        # each check asks every request's sender (a round trip to tritonserver): 4 a second
        # keep a cancel's wasted steps few and were 2.6% of a loaded step at 20 a second
        cancel_check_interval_s: float = 0.25,
        on_step: Callable[[DecodeStats], None] | None = None,
        before_step: Callable[[], None] | None = None,
        on_idle: Callable[[], None] | None = None,
        stuck_send_s: float = 5.0,  # a healthy send takes well under a millisecond
        on_stuck: Callable[[float], None] = _exit_process,
        stream_interval: int = 1,
        batch_slots: int = 0,
    ) -> None:
        """While more than half of `batch_slots` sequences decode, a sequence's tokens go
        out together every `stream_interval` steps (fewer responses through every hop to the
        client); its first token, and every token of a lightly loaded batch, at once."""
        if stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        self.engine = engine
        self.stream_interval = stream_interval
        self.batch_slots = batch_slots
        self.on_step = on_step  # called with engine.stats() after every step (metrics)
        # on the loop thread (engine/cpu_share.py): before each step, and as it runs out
        # of work
        self.before_step, self.on_idle = before_step, on_idle
        self.cancels = cancels
        self.cancel_check_interval_s = cancel_check_interval_s
        self.stuck_send_s = stuck_send_s
        self.on_stuck = on_stuck
        # request id -> its stream; added by submit() (Triton's thread), removed by the loop,
        # both under _wake
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Condition()
        self._stopped = False
        self._delivering_since: float | None = None
        self.dead: Exception | None = None
        self._outbox: list[_Send] = []  # the loop's responses, for the delivery thread
        self._out = threading.Condition()
        self._out_closed = False
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="decode-send", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="decode-watchdog", daemon=True)

    def start(self) -> DecodeService:
        self._thread.start()
        self._sender.start()
        self._watchdog.start()
        return self

    def stop(self) -> None:
        """Stop stepping; what was due goes out first."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)
        with self._out:
            self._out_closed = True
            self._out.notify()
        self._sender.join(timeout=10)

    def _watch(self) -> None:
        while not self._stopped:
            time.sleep(min(1.0, self.stuck_send_s / 4))
            since = self._delivering_since
            if since is not None and time.monotonic() - since > self.stuck_send_s:
                self.on_stuck(time.monotonic() - since)
                return

    def submit(
        self,
        request_id: str,
        params: SamplingParams,
        sink: Sink,
        *,
        prefill: PrefillResult | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        """Raises RequestError / CapacityError at once (after the acknowledgement); otherwise
        output flows to `sink`."""
        if self.dead is not None:
            raise EngineDeadError(f"decode engine is dead: {self.dead}")
        # The acknowledgement (tells the caller which worker to watch) goes out before the
        # engine can see the request: sent after, it raced the loop thread, which may finish
        # a short request at once, and a Triton response after the final one is a
        # use-after-free in the server (SIGSEGV in TRITONBACKEND_ResponseNewFromFactory).
        try:
            sink.send([], None)
        except Exception:  # the caller is gone already: nothing to do
            log.info("request %s: caller gone before decode started", request_id)
            return
        with self._wake:
            self.engine.add_request(request_id, params, prefill=prefill, prompt_ids=prompt_ids)
            self._streams[request_id] = _Stream(sink)
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                if not self.engine.has_unfinished and self.on_idle is not None:
                    self.on_idle()
                while not self._stopped and not self.engine.has_unfinished:
                    self._wake.wait()
                if self._stopped:
                    return
            try:
                if self.before_step is not None:
                    self.before_step()
                outputs = self.engine.step()
            except Exception as e:  # an engine bug or a broken model: fatal, and visible
                log.exception("decode engine died")
                self._die(e)
                return
            stats = self.engine.stats()  # once a step: the stream interval and the metrics
            self._post(self._plan(outputs, stats.num_running))
            if self.on_step is not None:
                try:
                    self.on_step(stats)
                except Exception:  # metrics must never stop decoding
                    log.exception("on_step hook failed")

    def _post(self, sends: list[_Send]) -> None:
        if sends:
            with self._out:
                self._outbox += sends
                self._out.notify()

    def _send_loop(self) -> None:
        last_check = 0.0
        while True:
            with self._out:
                if not self._outbox and not self._out_closed:
                    self._out.wait(self.cancel_check_interval_s)
                sends, self._outbox = self._outbox, []
                closed = self._out_closed
            self._send(_coalesce(sends))
            if closed and not sends:
                return
            now = time.monotonic()
            if now - last_check >= self.cancel_check_interval_s:
                last_check = now
                self._check_cancels()

    def _interval(self, num_running: int) -> int:
        """Tokens per response now: the configured interval while over half the batch
        slots decode, else 1."""
        if self.stream_interval > 1 and 2 * num_running > self.batch_slots:
            return self.stream_interval
        return 1

    def _deliver(self, outputs: list[TokenOutput], num_running: int) -> None:
        """A step's responses sent at once, on this thread (the planner's simulator)."""
        self._send(self._plan(outputs, num_running))

    def _plan(self, outputs: list[TokenOutput], num_running: int) -> list[_Send]:
        """The responses a step's outputs make due (the stream interval holds tokens back
        under load; a request's first token, and its last, go out at once)."""
        tokens: dict[str, list[int]] = defaultdict(list)
        logprobs: dict[str, list[TokenLogprob]] = defaultdict(list)
        finished: dict[str, str] = {}
        cached: dict[str, int] = {}
        for o in outputs:
            if o.token_id is not None:
                tokens[o.request_id].append(o.token_id)
                if o.logprob is not None:
                    logprobs[o.request_id].append(o.logprob)
            if o.index == 0 and o.num_reused_tokens:
                cached[o.request_id] = o.num_reused_tokens
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason.value
        interval = self._interval(num_running)
        with self._wake:
            held = {rid for rid, s in self._streams.items() if s.held} if interval == 1 else set()
            due = [(rid, self._streams.get(rid)) for rid in tokens.keys() | finished.keys() | held]
            for rid in finished:
                self._streams.pop(rid, None)
        sends = []
        for rid, stream in due:
            if stream is None:
                continue
            if (
                rid not in finished
                and stream.started
                and len(stream.held) + len(tokens.get(rid, ())) < interval
            ):
                stream.hold(tokens.get(rid, []), logprobs.get(rid, []))  # out with the next
                continue
            batch, lps = stream.take(tokens.get(rid, []), logprobs.get(rid, []))
            if rid in finished:
                if self.cancels:
                    self.cancels.clear(rid)
            elif batch:
                stream.started = True
            sends.append(_Send(rid, stream.sink, batch, finished.get(rid), cached.get(rid, 0), lps))
        return sends

    def _send(self, sends: list[_Send]) -> None:
        for s in sends:
            self._delivering_since = time.monotonic()
            try:
                if s.error is not None:
                    s.sink.fail(s.error)
                    continue
                # (one per token or none: an engine that could not say for some sends none)
                lps = s.logprobs if s.logprobs and len(s.logprobs) == len(s.tokens) else None
                s.sink.send(s.tokens, s.finish, s.num_cached_tokens, lps)
            except Exception:  # the client is gone: stop spending steps on it
                log.info("request %s: sending failed; finishing it", s.rid)
                self.engine.finish_request(s.rid, FinishReason.ABORT)
            finally:
                self._delivering_since = None

    def _check_cancels(self) -> None:
        with self._wake:
            streams = list(self._streams.items())
        for rid, stream in streams:
            if (self.cancels and self.cancels.is_marked(rid)) or stream.sink.is_cancelled():
                self.engine.finish_request(rid, FinishReason.ABORT)

    def _die(self, error: Exception) -> None:
        self.dead = error
        with self._wake:
            streams, self._streams = list(self._streams.items()), {}
        failure = EngineDeadError(f"decode engine died: {error}")
        self._post([_Send(rid, stream.sink, error=failure) for rid, stream in streams])
