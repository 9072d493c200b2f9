"""The conditional serving mode's cost model: prefill this prompt in the prefill pool, or let
the decode pool prefill it itself? No Triton here.

The choices differ in how fast the prefill runs and in who waits for it:

    local  (decode prefills):  the request waits for the prompts decode is already
                               prefilling, then for its prefill, and every sequence decoding
                               in that engine waits for its compute: with chunked prefill the
                               stall is spread over its steps (a chunk per step) but adds up
                               the same.
        local_cost  = Q_local + P_local + A * C_local
    remote (prefill pool):     the request waits for the prefill pool's queue, its prefill and
                               the KV hand-off; decoding sequences go on, slowed only as far as
                               the prefill pool shares their hardware (`remote_stall`: 0 on
                               separate GPUs, about the pool's share of the cores when both
                               pools share a CPU).
        remote_cost = Q + P_remote + H + A * C_remote * remote_stall

    P_local  = F_local + prompt tokens x decode's own prefill seconds per token (learned
               from the time decode takes to answer a request it prefills beside running
               sequences: chunks interleaved with decode steps included)
    P_remote = F_remote + prompt tokens x the prefill pool's seconds per token (learned from
               its reports; on shared cores it includes the contention with decode)
    C = P less F: a prefill's fixed cost (the call, waiting for a step) holds up only its
        own request
    A = sequences this orchestrator has in decode now
    Q = (prompt tokens queued at the prefill pool x its seconds per token + prompts queued
        there x F_remote) / prefill instances
    Q_local = prompt tokens decode is prefilling for this orchestrator (sent, no first token
        yet) x decode's seconds per token
    H = hand-off fixed cost + prompt tokens x hand-off seconds per token   (per token: learned)

Each side's prefill time is learned as a fixed cost F (from prompts shorter than
`min_slope_tokens`, whose time is mostly the call and the step they wait for) plus a cost per
token (from longer ones, less F): counting a 64-token prompt's fixed costs per token once
made a 1,600-token prompt look 1.7x slower to prefill away than it was. Until decode has
prefilled a long prompt beside running sequences, its speed per token is taken as the
prefill pool's (the same engine; on shared cores the pool's reports include the contention):
a constant prior that nothing corrects once long prompts go away kept them local on one run
and not on the next. A prompt decode prefills while nothing else decodes teaches nothing: it
runs at a speed the decision never needs (that case is local anyway).

`remote_stall` is learned too, once enough tokens were seen both ways: a decode step that
takes g seconds alone and g' while the prefill pool works loses (1 - g / g') of its time to
the prefill, so remote_stall = 1 - median(g) / median(g'), from the token gaps the
orchestrator streams (medians: a co-located prefill's one long gap does not move them).

On separate hardware P_remote ~ P_local and the stall ~ 0: remote wins once the running
sequences' stall outweighs the hand-off. On shared cores the split depends on who yields:
a chunked local prefill slows every decode step by its chunk's compute (the streams ran at
15-22 tok/s against 80-97 with the long prompts sent away, docs/benchmarks.md), while a
prefill pool running one thread at nice 10 (prefill_yield.py) slows them by 10-20%.

The cheaper side wins; ties go local (no hand-off to fail). Each decision names its reason:
  decode_idle     local: nothing is decoding, so a local prefill delays nobody
  prefill_queue   local: the prefill pool's queue costs more than stalling decode
  short_prompt    local: the hand-off costs more than the short stall
  protect_decode  remote: stalling the running sequences would cost more
  prefix_cached   local: decode holds most of this prompt's K/V already

Each side prefills only what its prefix cache lacks (`cached_local`, `cached_remote`: the
orchestrator's estimate, pipeline/prefix_locality.py), and the hand-off moves only what
decode lacks (pipeline/handoff.py: H counts the tokens after `cached_local`).

Costs are in seconds of added waiting summed over the requests affected: one second of a new
request's TTFT weighs as much as one second of stall for each running sequence.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

DECODE_IDLE = "decode_idle"
PREFILL_QUEUE = "prefill_queue"
SHORT_PROMPT = "short_prompt"
PROTECT_DECODE = "protect_decode"
PREFIX_CACHED = "prefix_cached"
REASONS = (DECODE_IDLE, PREFILL_QUEUE, SHORT_PROMPT, PROTECT_DECODE, PREFIX_CACHED)


@dataclass(frozen=True)
class CostParams:
    prefill_s_per_token: float = 1.5e-3  # first guess for both sides (SmolLM2-135M, 2 cores)
    handoff_fixed_s: float = 0.005  # serialise + BLS round trip of an empty payload (fixed)
    handoff_s_per_token: float = 2e-5  # ~46 KB of fp32 K/V per token; learned
    remote_stall: float = 0.5  # prior: fraction of a remote prefill that still slows decode
    prefill_instances: int = 1
    learn_rate: float = 0.2  # weight of a new observation in the running estimates
    gap_window: int = 256  # token gaps kept per state for the stall estimate
    min_gaps: int = 32  # gaps needed in each state before the estimate replaces the prior
    # prefills shorter than this teach a side's fixed cost, longer ones its cost per token
    min_slope_tokens: int = 256


@dataclass(frozen=True)
class Load:
    """What the orchestrator knows of its pools when a request arrives."""

    prefill_queue_tokens: int  # prompt tokens sent to the prefill pool and not yet back
    decode_active: int  # sequences this orchestrator has in the decode pool
    prefill_queue_requests: int = 0  # the prompts those tokens belong to
    # prompt tokens decode is prefilling itself for this orchestrator, first token not yet
    # back: a prompt prefilled locally waits for them as a remote one waits for the pool's
    local_queue_tokens: int = 0


@dataclass(frozen=True)
class Decision:
    remote: bool  # True: the prefill pool prefills; False: decode does
    reason: str  # one of REASONS
    local_cost_s: float
    remote_cost_s: float
    local_prefill_s: float  # P_local
    remote_prefill_s: float  # P_remote
    queue_s: float  # Q
    handoff_s: float  # H
    remote_stall: float  # the estimate used

    def explain(self) -> str:
        side = "remote" if self.remote else "local"
        return (
            f"{side} ({self.reason}): local {self.local_cost_s * 1e3:.1f} ms vs remote "
            f"{self.remote_cost_s * 1e3:.1f} ms [prefill {self.local_prefill_s * 1e3:.1f} here / "
            f"{self.remote_prefill_s * 1e3:.1f} there, "
            f"queue {self.queue_s * 1e3:.1f}, hand-off {self.handoff_s * 1e3:.1f} ms, "
            f"remote stall {self.remote_stall:.2f}]"
        )


class CostModel:
    """Thread-safe: the orchestrator decides and observes from many request threads."""

    def __init__(self, params: CostParams | None = None) -> None:
        self.params = p = params or CostParams()
        if p.prefill_instances < 1 or not 0.0 <= p.remote_stall <= 1.0:
            raise ValueError("need prefill_instances >= 1 and 0 <= remote_stall <= 1")
        self.local_s_per_token = p.prefill_s_per_token
        self.remote_s_per_token = p.prefill_s_per_token
        self.local_fixed_s = self.remote_fixed_s = 0.0
        self.local_learned = False  # has decode prefilled a long prompt beside others yet?
        self.handoff_fixed_s = p.handoff_fixed_s
        self.handoff_s_per_token = p.handoff_s_per_token
        self.remote_stall = p.remote_stall
        # token gaps while no remote prefill runs / while one does
        self._gaps: dict[bool, deque[float]] = {
            False: deque(maxlen=p.gap_window),
            True: deque(maxlen=p.gap_window),
        }
        self._lock = threading.Lock()

    def decide(
        self, num_prompt_tokens: int, load: Load, cached_local: int = 0, cached_remote: int = 0
    ) -> Decision:
        """`cached_*`: leading prompt tokens decode (local) or the prefill pool (remote)
        would take from its prefix cache rather than compute."""
        p = self.params
        with self._lock:
            remote_spt = self.remote_s_per_token
            local_spt = self._local_spt()
            stall = self.remote_stall
            moved = max(num_prompt_tokens - cached_local, 1)  # decode holds the rest
            handoff = self.handoff_fixed_s + moved * self.handoff_s_per_token
            c_local = max(num_prompt_tokens - cached_local, 1) * local_spt
            c_remote = max(num_prompt_tokens - cached_remote, 1) * remote_spt
            p_local, p_remote = self.local_fixed_s + c_local, self.remote_fixed_s + c_remote
            queued = load.prefill_queue_tokens * remote_spt
            queued += load.prefill_queue_requests * self.remote_fixed_s
        queue = queued / p.prefill_instances
        local = load.local_queue_tokens * local_spt + p_local + load.decode_active * c_local
        remote = queue + p_remote + handoff + load.decode_active * c_remote * stall
        if remote < local:
            reason = PROTECT_DECODE
        elif 2 * cached_local >= num_prompt_tokens > cached_remote:
            reason = PREFIX_CACHED
        elif load.decode_active == 0:
            reason = DECODE_IDLE
        elif queue > handoff:
            reason = PREFILL_QUEUE
        else:
            reason = SHORT_PROMPT
        return Decision(
            remote < local, reason, local, remote, p_local, p_remote, queue, handoff, stall
        )

    def estimates(self) -> dict[str, float]:
        """What decisions are made with now (the metrics' `estimate` labels)."""
        with self._lock:
            local = self._local_spt()
            return {
                "remote_stall": self.remote_stall,
                "local_prefill_s_per_token": local,
                "remote_prefill_s_per_token": self.remote_s_per_token,
                "local_prefill_fixed_s": self.local_fixed_s,
                "remote_prefill_fixed_s": self.remote_fixed_s,
                "handoff_s_per_token": self.handoff_s_per_token,
            }

    def observe_prefill(self, num_tokens: int, compute_s: float) -> None:
        """A prefill the pool reported: its compute time for `num_tokens` prompt tokens."""
        if num_tokens > 0 and compute_s > 0:
            with self._lock:
                self.remote_fixed_s, self.remote_s_per_token = self._learn(
                    self.remote_fixed_s, self.remote_s_per_token, num_tokens, compute_s
                )

    def observe_local_prefill(
        self, num_tokens: int, seconds: float, beside: int = 1, ahead_tokens: int = 0
    ) -> None:
        """A prompt decode prefilled itself while `beside` other sequences decoded: request
        sent -> first token (which includes waiting for decode's current step), with
        `ahead_tokens` of other prompts decode was prefilling for us when it was sent: the
        wait for those is load, decided on as such (Load.local_queue_tokens), and is taken
        out here, or a burst's queueing would be learned as every prompt's fixed cost."""
        if num_tokens > 0 and seconds > 0 and beside > 0:
            with self._lock:
                if ahead_tokens > 0:
                    seconds = max(seconds - ahead_tokens * self._local_spt(), 0.0)
                if not self.local_learned:  # from what decisions assumed, not the prior
                    self.local_s_per_token = self.remote_s_per_token
                self.local_fixed_s, self.local_s_per_token = self._learn(
                    self.local_fixed_s, self.local_s_per_token, num_tokens, seconds
                )
                self.local_learned |= num_tokens >= self.params.min_slope_tokens

    def _learn(self, fixed: float, per_token: float, n: int, seconds: float) -> tuple[float, float]:
        """(fixed, per token) after a prefill of n tokens took `seconds`."""
        if n < self.params.min_slope_tokens:
            return self._mix(fixed, max(seconds - n * per_token, 0.0)), per_token
        return fixed, self._mix(per_token, max(seconds - fixed, 0.0) / n)

    def observe_handoff(self, num_tokens: int, seconds: float) -> None:
        """A hand-off's measured time: the part over the fixed cost is charged per token."""
        if num_tokens > 0 and seconds > 0:
            with self._lock:
                per_token = max(seconds - self.handoff_fixed_s, 0.0) / num_tokens
                self.handoff_s_per_token = self._mix(self.handoff_s_per_token, per_token)

    def observe_gap(self, gap_s: float, remote_prefill_running: bool) -> None:
        """A token gap of a decoding sequence, and whether the prefill pool was working."""
        with self._lock:
            gaps = self._gaps[remote_prefill_running]
            gaps.append(gap_s)
            idle, busy = self._gaps[False], self._gaps[True]
            if len(gaps) % 8 == 0 and min(len(idle), len(busy)) >= self.params.min_gaps:
                g, g_busy = statistics.median(idle), statistics.median(busy)
                self.remote_stall = min(max(1 - g / g_busy, 0.0), 1.0) if g_busy > 0 else 0.0

    def _local_spt(self) -> float:
        """Decode's prefill seconds per token as decisions take it: the pool's until decode
        has prefilled a long prompt beside others (the caller holds the lock)."""
        return self.local_s_per_token if self.local_learned else self.remote_s_per_token

    def _mix(self, old: float, new: float) -> float:
        return (1 - self.params.learn_rate) * old + self.params.learn_rate * new


class LoadTracker:
    """The orchestrator's own count of work it has in the pools (one orchestrator instance
    sees all the traffic by default; with several, each sees its share). `on_change` gets
    each new Load (a metrics gauge)."""

    def __init__(self, on_change: Callable[[Load], None] | None = None) -> None:
        self._lock = threading.Lock()
        self.prefill_queue_tokens = 0
        self.prefill_queue_requests = 0
        self.local_queue_tokens = 0
        self.decode_active = 0
        self.on_change = on_change

    def snapshot(self) -> Load:
        with self._lock:
            return self._load()

    def _load(self) -> Load:
        return Load(
            self.prefill_queue_tokens,
            self.decode_active,
            self.prefill_queue_requests,
            self.local_queue_tokens,
        )

    def local_prefill(self, num_tokens: int) -> LocalPrefill:
        """A prompt of `num_tokens` decode prefills itself, counted as waiting until its
        first token comes (`LocalPrefill.done`) or it ends without one (leaving the block)."""
        with self._lock:
            ahead = self.local_queue_tokens
            self.local_queue_tokens += num_tokens
        return LocalPrefill(self, num_tokens, ahead)

    def _local_done(self, num_tokens: int) -> None:
        with self._lock:
            self.local_queue_tokens -= num_tokens

    def add_prefill(self, num_tokens: int) -> None:
        """A prompt of `num_tokens` sent to the prefill pool (negative: back from it)."""
        with self._lock:
            self.prefill_queue_tokens += num_tokens
            self.prefill_queue_requests += (num_tokens > 0) - (num_tokens < 0)
            load = self._load()
        if self.on_change is not None:
            self.on_change(load)

    def add_decode(self, n: int) -> None:
        with self._lock:
            self.decode_active += n


class LocalPrefill:
    """One prompt in LoadTracker.local_queue_tokens; `ahead`: the tokens before it."""

    def __init__(self, tracker: LoadTracker, num_tokens: int, ahead: int) -> None:
        self.tracker, self.num_tokens, self.ahead = tracker, num_tokens, ahead

    def done(self) -> None:
        """Its first token came (idempotent)."""
        n, self.num_tokens = self.num_tokens, 0
        if n:
            self.tracker._local_done(n)

    def __enter__(self) -> LocalPrefill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()
