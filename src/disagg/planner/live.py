"""The live planner's decisions: from what the frontend's metrics showed over the last few
seconds, how many prefill and decode replicas to run (issue 26 item 5).

A `Window` is the change between two scrapes of the frontend's Triton metrics `seconds`
apart (gauges: their mean over the scrapes between): the prefill pool's queue time p90
(`disagg_queue_seconds{pool=prefill}`: a growing queue shows there before TTFT does, which a
queue-blind planner misses, as Dynamo's users report in ai-dynamo/dynamo#10528), TTFT p90,
the seconds the prefill replicas spent computing, the prompt tokens waiting for prefill,
ITL p90, and the requests this frontend has in flight on the decode replicas.

Rules, each pool on its own (`Planner.observe`), over the last `up_for_s` and `down_for_s`:

- up, when the window breaches (prefill: queue p90 over `queue_s`, TTFT p90 over `ttft_s`,
  or prompts waiting while none finished: "stalled"; decode: ITL p90 over `itl_s`, or more
  in flight per replica than `decode_seqs`) and there are fewer than `max` replicas;
- down, when the window is calm (no breach, the queue p90 under a quarter of its target)
  and its work would fit on one replica fewer at `down_busy` of each (prefill: compute
  seconds per second; decode: in flight against `decode_seqs`), above `min` replicas;
- never twice within `cooldown_s` on the same pool, and only on a window that began after
  the pool's last action (one that saw the old replica count decides nothing).

A window without a finished prefill has no queue or TTFT figures: calm, unless prompts were
waiting all along.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from disagg import status as S

PREFILL, DECODE = "prefill", "decode"
SOURCE = "frontend"  # the label autoscale.py gives each frontend's samples
UP, DOWN = "up", "down"


@dataclass(frozen=True)
class Targets:
    ttft_s: float = 4.0  # TTFT p90 above this: add prefill
    queue_s: float = 1.0  # prefill queue p90 above this: add prefill
    itl_s: float = 0.5  # ITL p90 above this: add decode
    decode_seqs: int = 16  # sequences one decode replica runs at once (its max_num_seqs)
    down_busy: float = 0.5  # scale down when the work fits one replica fewer at this busy
    up_for_s: float = 6.0
    down_for_s: float = 20.0
    cooldown_s: float = 30.0
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4

    def bounds(self, pool: str) -> tuple[int, int]:
        if pool == PREFILL:
            return self.min_prefill, self.max_prefill
        return self.min_decode, self.max_decode


@dataclass(frozen=True)
class Window:
    """What the seconds before `end` showed (NaN: no observation in them)."""

    seconds: float
    end: float = 0.0  # on the planner's clock
    prefilled: float = 0.0  # requests the prefill pool finished
    queue_p90_s: float = math.nan
    ttft_p90_s: float = math.nan
    prefill_busy_s: float = 0.0  # compute seconds the prefill replicas spent
    prefill_waiting: float = 0.0  # prompt tokens sent to prefill and not back (mean)
    itl_p90_s: float = math.nan
    decode_in_flight: float = 0.0  # requests this frontend has on decode replicas (mean)

    @property
    def start(self) -> float:
        return self.end - self.seconds

    @classmethod
    def between(cls, scrapes: list[list[S.Sample]], seconds: float, end: float = 0.0) -> Window:
        """From the scrapes of a span, oldest first (at least two). Samples may carry a
        `frontend` label (autoscale.py adds it); counts change per frontend, and only of the
        frontends in both the first and the last scrape (one that came meanwhile would add
        its whole history; one that restarted counts from zero: its change is clamped)."""
        common = {s.label(SOURCE) for s in scrapes[0]} & {s.label(SOURCE) for s in scrapes[-1]}

        def of(x: list[S.Sample], src: str, **labels: str) -> list[S.Sample]:
            return [
                s for s in x
                if s.label(SOURCE) == src and all(s.label(k) == v for k, v in labels.items())
            ]  # fmt: skip

        def mean(name: str, **labels: str) -> float:
            values = [S.total(x, name, **labels) for x in scrapes[1:]]
            return sum(values) / len(values)

        def hist(name: str, **labels: str) -> dict[float, float]:
            out: dict[float, float] = {}
            for src in common:
                now = S.buckets(of(scrapes[-1], src, **labels), name)
                change = S.delta(now, S.buckets(of(scrapes[0], src, **labels), name))
                for le, n in change.items():
                    out[le] = out.get(le, 0.0) + max(0.0, n)
            return out

        def grew(name: str, **labels: str) -> float:
            return sum(
                max(0.0, S.total(of(scrapes[-1], src), name, **labels)
                    - S.total(of(scrapes[0], src), name, **labels))
                for src in common
            )  # fmt: skip

        queue = hist("disagg_queue_seconds", pool=PREFILL)
        return cls(
            seconds=seconds,
            end=end,
            prefilled=max(queue.values(), default=0.0),
            queue_p90_s=S.quantile(0.9, queue),
            ttft_p90_s=S.quantile(0.9, hist("disagg_ttft_seconds")),
            prefill_busy_s=grew("disagg_prefill_seconds_sum", pool=PREFILL),
            prefill_waiting=mean("disagg_prefill_queue_tokens"),
            itl_p90_s=S.quantile(0.9, hist("disagg_itl_seconds")),
            decode_in_flight=mean("disagg_replica_outstanding_requests", pool=DECODE),
        )


@dataclass(frozen=True)
class Decision:
    pool: str
    action: str  # UP or DOWN
    replicas: int  # the count after it
    reason: str  # queue, ttft, itl, in_flight, idle
    detail: str  # the figures behind it, for the log and `disagg status`


@dataclass
class _Pool:
    replicas: int
    last_action: float = -math.inf


class Planner:
    def __init__(self, targets: Targets, prefill: int, decode: int) -> None:
        self.targets = targets
        self.pools = {PREFILL: _Pool(prefill), DECODE: _Pool(decode)}

    def replicas(self, pool: str) -> int:
        return self.pools[pool].replicas

    def observe(self, now: float, up: Window | None, down: Window | None) -> list[Decision]:
        """The decisions from the windows of the last `up_for_s` and `down_for_s` (None: not
        that much seen yet), applied already to the replica counts: the caller carries
        them out."""
        out = []
        t = self.targets
        for pool in (PREFILL, DECODE):
            p = self.pools[pool]
            lo, hi = t.bounds(pool)
            if now - p.last_action < t.cooldown_s:
                continue
            if up is not None and up.start >= p.last_action and p.replicas < hi:
                breach, _, detail = self._judge(pool, p.replicas, up)
                if breach is not None:
                    out.append(self._act(pool, p, now, UP, breach, detail))
                    continue
            if down is not None and down.start >= p.last_action and p.replicas > lo:
                breach, calm, detail = self._judge(pool, p.replicas, down)
                if breach is None and calm:
                    out.append(self._act(pool, p, now, DOWN, "idle", detail))
        return out

    def _judge(self, pool: str, n: int, w: Window) -> tuple[str | None, bool, str]:
        """(the breach's reason or None, calm enough to shrink, the figures)."""
        t = self.targets
        if pool == PREFILL:
            detail = (
                f"over {w.seconds:.0f} s: queue p90 {_fmt(w.queue_p90_s)}, TTFT p90 "
                f"{_fmt(w.ttft_p90_s)}, prefill busy {w.prefill_busy_s / w.seconds:.2f} "
                f"of {n} replicas, {w.prefill_waiting:.0f} prompt tokens waiting"
            )
            breach = (
                "queue"
                if w.queue_p90_s > t.queue_s
                else "ttft"
                if w.ttft_p90_s > t.ttft_s
                else "stalled"
                if w.prefilled == 0 and w.prefill_waiting > 0
                else None
            )
            quiet = not w.queue_p90_s > t.queue_s / 4  # NaN (no requests) is quiet
            fits = w.prefill_busy_s / w.seconds <= t.down_busy * (n - 1)
            return breach, quiet and fits, detail
        per = w.decode_in_flight / max(1, n)
        detail = (
            f"over {w.seconds:.0f} s: ITL p90 {_fmt(w.itl_p90_s)}, "
            f"{w.decode_in_flight:.1f} in flight on {n}"
        )
        breach = "itl" if w.itl_p90_s > t.itl_s else "in_flight" if per > t.decode_seqs else None
        fits = w.decode_in_flight <= t.down_busy * t.decode_seqs * (n - 1)
        return breach, fits, detail

    def _act(
        self, pool: str, p: _Pool, now: float, action: str, reason: str, detail: str
    ) -> Decision:
        p.replicas += 1 if action == UP else -1
        p.last_action = now
        return Decision(pool, action, p.replicas, reason, detail)


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.0f} ms"
