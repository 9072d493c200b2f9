"""Benchmark statistics from per-request timelines. No I/O: tests feed synthetic timelines.

Definitions (the ones vLLM's and NVIDIA's benchmark tools use):
  TTFT  first token time - send time
  TPOT  (end - first token) / (output tokens - 1): mean time per token after the first
  ITL   gaps between successive streamed chunks, each gap spread evenly over the tokens the
        later chunk carried (one value per token after the first)
  e2e   end - send
A request meets its SLO when it finished without error and TTFT <= ttft_s and TPOT <= tpot_s
(a one-token reply has no TPOT and meets it). Attainment is the share of measured requests
meeting it; goodput is the highest offered rate whose attainment is >= the target (90%).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass
class Timeline:
    """One request as the client saw it; times in seconds on one monotonic clock."""

    cls: str
    send_s: float
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with text
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk (1 if unknown)
    end_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_s)

    @property
    def ttft(self) -> float:
        return self.chunk_s[0] - self.send_s

    @property
    def e2e(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.end_s - self.chunk_s[0]) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        out = []
        for k in range(1, len(self.chunk_s)):
            n = max(self.chunk_tokens[k] if k < len(self.chunk_tokens) else 1, 1)
            out += [(self.chunk_s[k] - self.chunk_s[k - 1]) / n] * n
        return out


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, t: Timeline) -> bool:
        if not t.ok or t.ttft > self.ttft_s:
            return False
        tpot = t.tpot
        return tpot is None or tpot <= self.tpot_s


@dataclass
class Dist:
    mean: float
    p50: float
    p90: float
    p99: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Dist:
        if not values:
            return cls(float("nan"), float("nan"), float("nan"), float("nan"), 0)
        a = np.asarray(values, float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])  # linear interpolation
        return cls(float(a.mean()), float(p50), float(p90), float(p99), len(a))


@dataclass
class ClassSummary:
    cls: str
    num_requests: int
    num_errors: int
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    output_tokens_per_s: float
    requests_per_s: float  # finished requests per second of the measured window
    slo_attainment: float | None = None  # with an SLO
    goodput_requests_per_s: float | None = None  # SLO-meeting requests per second

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measured(timelines: list[Timeline], warmup: int) -> list[Timeline]:
    """Drop the first `warmup` requests by send time (caches, allocators, thread pools)."""
    return sorted(timelines, key=lambda t: t.send_s)[warmup:]


def summarize(
    timelines: list[Timeline], cls: str, slo: SLO | dict[str, SLO] | None = None
) -> ClassSummary:
    """One class (or "all") of already-measured timelines; `slo` is one for every class or
    one per class (then "all" judges each request by its own class's SLO)."""
    ts = [t for t in timelines if cls == "all" or t.cls == cls]
    ok = [t for t in ts if t.ok]
    window = (max(t.end_s for t in ok) - min(t.send_s for t in ts)) if ok else 0.0
    summary = ClassSummary(
        cls=cls,
        num_requests=len(ts),
        num_errors=len(ts) - len(ok),
        ttft=Dist.of([t.ttft for t in ok]),
        tpot=Dist.of([t.tpot for t in ok if t.tpot is not None]),
        itl=Dist.of([x for t in ok for x in t.itls()]),
        e2e=Dist.of([t.e2e for t in ok]),
        output_tokens_per_s=sum(t.output_tokens for t in ok) / window if window else 0.0,
        requests_per_s=len(ok) / window if window else 0.0,
    )
    if slo is not None and ts:
        met = sum((slo[t.cls] if isinstance(slo, dict) else slo).met(t) for t in ts)
        summary.slo_attainment = met / len(ts)
        summary.goodput_requests_per_s = met / window if window else 0.0
    return summary


def goodput_rate(attainment_by_rate: dict[float, float], target: float = 0.9) -> float:
    """The highest offered rate whose attainment meets the target, provided every lower rate
    met it too (a sweep that fails at 1/s and passes at 2/s by noise does not count 2/s);
    0 if even the lowest rate misses it."""
    best = 0.0
    for rate in sorted(attainment_by_rate):
        if attainment_by_rate[rate] < target:
            break
        best = rate
    return best


def calibrate_slo(
    unloaded: list[Timeline], ttft_factor: float = 3.0, tpot_factor: float = 2.0
) -> SLO:
    """SLOs as multiples of unloaded (one request at a time) p50 latency."""
    ok = [t for t in unloaded if t.ok]
    if not ok:
        raise ValueError("no successful unloaded request to calibrate from")
    tpots = [t.tpot for t in ok if t.tpot is not None]
    ttft = float(np.median([t.ttft for t in ok]))
    tpot = float(np.median(tpots)) if tpots else 0.1
    return SLO(ttft_factor * ttft, tpot_factor * tpot)


def bootstrap_sd(x: npt.NDArray[np.float64], q: float, rng: np.random.Generator,
                 draws: int = 2000) -> float:  # fmt: skip
    """The q-th percentile's standard deviation over resamples of `x`, relative to the
    percentile itself (a fraction; nan with fewer than two values). Treats the values as
    independent, which requests under load are not: a floor, not the whole spread."""
    if len(x) < 2:
        return math.nan
    picks = rng.integers(0, len(x), size=(draws, len(x)))
    est = np.percentile(x[picks], q, axis=1)
    return float(est.std() / np.percentile(x, q))


def rerun_needs(n: int, sd: float, points: float) -> int:
    """How many values per run keep two runs' percentiles within `points` percent of each
    other with 90% probability, if one run of `n` has relative spread `sd`: their difference
    spreads sqrt(2) times as much, and a percentile's spread goes as 1/sqrt(n)."""
    if math.isnan(sd):
        return 0
    limit = points / 100 / (1.645 * math.sqrt(2))
    return max(1, math.ceil(n * (sd / limit) ** 2))
