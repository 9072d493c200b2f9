"""Cost models fitted from a profile's measurements: what one piece of engine work takes.

    Linear           fixed_s + per_unit_s * x                 hand-offs and KV copies, by bytes
    PiecewiseLinear  interpolation between measured knots     a whole prefill, by prompt tokens
    ChunkCost        m(n) + c * n * (start + n)               a prefill chunk of n tokens after
                                                              `start` positions (m: the matmuls,
                                                              piecewise linear in n; c: attention)
    DecodeCost       base(B) + per_position(B) * T            a decode step of B rows attending
                                                              T positions (base, per_position:
                                                              piecewise linear in B)

Torch-free and JSON-ready (`to_json` / `from_json`). Fits are least squares, clamped
non-negative, and made non-decreasing over their knots (pool-adjacent-violators): a noisy
measurement must not make a longer prompt or a larger batch cheaper in the simulator. The
one exception is a kernel boundary (`breaks`): prompt rows past engine/quant.py's
DIRECT_ROWS leave the block kernel for the dense copy of the weights, and 65 rows cost less
than 64 (measured: a 128-token chunk as much as a 64-token one); each side of a break is
made non-decreasing on its own.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class Linear:
    fixed_s: float
    per_unit_s: float

    def __call__(self, x: float) -> float:
        return self.fixed_s + self.per_unit_s * x

    def to_json(self) -> dict[str, Any]:
        return {"fixed_s": self.fixed_s, "per_unit_s": self.per_unit_s}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Linear:
        return cls(float(d["fixed_s"]), float(d["per_unit_s"]))


@dataclass(frozen=True)
class PiecewiseLinear:
    """Straight lines between knots (xs ascending); below the first knot its value (a short
    input costs what the smallest measured one did), past the last the last segment's slope."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.xs or len(self.xs) != len(self.ys) or list(self.xs) != sorted(set(self.xs)):
            raise ValueError("PiecewiseLinear needs ascending, distinct knots, one value each")

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0] or len(xs) == 1:
            return ys[0] if x <= xs[0] else ys[-1]
        i = min(bisect.bisect_right(xs, x), len(xs) - 1)  # segment (i - 1, i)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def to_json(self) -> dict[str, Any]:
        return {"xs": list(self.xs), "ys": list(self.ys)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PiecewiseLinear:
        return cls(tuple(float(x) for x in d["xs"]), tuple(float(y) for y in d["ys"]))


@dataclass(frozen=True)
class ChunkCost:
    """Seconds of `Llama.prefill_chunk` for n prompt tokens after `start` cached positions:
    the matmuls grow with n, attention with n * (start + n)."""

    fixed_s: float  # a line through every size's matmul time (what `matmul` refines)
    per_token_s: float
    per_pair_s: float  # one query token against one visible position
    # the matmul time at each measured chunk size (the attention term taken out), between
    # them interpolated: what the line misses at a kernel boundary. None: the line
    matmul: PiecewiseLinear | None = None

    def __call__(self, n: int, start: int) -> float:
        m = self.matmul(n) if self.matmul is not None else self.fixed_s + self.per_token_s * n
        return m + self.per_pair_s * n * (start + n)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"fixed_s": self.fixed_s, "per_token_s": self.per_token_s,
                             "per_pair_s": self.per_pair_s}  # fmt: skip
        if self.matmul is not None:
            d["matmul"] = self.matmul.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChunkCost:
        matmul = PiecewiseLinear.from_json(d["matmul"]) if "matmul" in d else None
        return cls(float(d["fixed_s"]), float(d["per_token_s"]), float(d["per_pair_s"]), matmul)


@dataclass(frozen=True)
class DecodeCost:
    """Seconds of one `DecodeEngine.step()` decode (sampling included) over `rows` batch rows
    whose attention spans `positions` KV positions (the longest sequence's, plus one)."""

    base: PiecewiseLinear  # rows -> seconds at zero context
    per_position: PiecewiseLinear  # rows -> seconds per attended position

    def __call__(self, rows: int, positions: int) -> float:
        return self.base(rows) + self.per_position(rows) * positions

    def to_json(self) -> dict[str, Any]:
        return {"base": self.base.to_json(), "per_position": self.per_position.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DecodeCost:
        return cls(
            PiecewiseLinear.from_json(d["base"]), PiecewiseLinear.from_json(d["per_position"])
        )


# ---------------------------------------------------------------- fitting


def nondecreasing(ys: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1), (m2, w2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2]
    return [m for m, w in blocks for _ in range(int(w))]


def _medians(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """Repeated measurements of one x become their median; xs ascending."""
    by_x: dict[float, list[float]] = defaultdict(list)
    for x, y in zip(xs, ys, strict=True):
        by_x[float(x)].append(float(y))
    keys = sorted(by_x)
    return keys, [float(np.median(by_x[k])) for k in keys]


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> Linear:
    """Least squares line, slope and intercept >= 0 (a negative intercept refits through 0)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(set(xs)) < 2:
        return Linear(max(float(np.median(y)), 0.0), 0.0)
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        return Linear(max(float(y.mean()), 0.0), 0.0)
    if intercept < 0:
        return Linear(0.0, float(x @ y / (x @ x)))
    return Linear(float(intercept), float(slope))


def fit_piecewise(
    xs: Sequence[float], ys: Sequence[float], breaks: Sequence[float] = ()
) -> PiecewiseLinear:
    """The median at each x, non-decreasing between `breaks` (x <= a break is on its left)."""
    knots, values = _medians(xs, ys)
    side = [bisect.bisect_left(sorted(breaks), k) for k in knots]
    smooth: list[float] = []
    for part in sorted(set(side)):
        smooth += nondecreasing([v for v, s in zip(values, side, strict=True) if s == part])
    return PiecewiseLinear(tuple(knots), tuple(max(v, 0.0) for v in smooth))


def _nonneg_lstsq(
    features: npt.NDArray[np.float64], y: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Least squares with every coefficient >= 0: a negative one is dropped and the rest
    refitted (three features: the active set settles in at most three rounds)."""
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(features[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [a for a, s in zip(active, sol, strict=True) if s >= 0]
    return coef


def fit_chunk(
    ns: Sequence[int], starts: Sequence[int], ys: Sequence[float], breaks: Sequence[float] = ()
) -> ChunkCost:
    """The three-term line by least squares; then, its attention term taken out of each
    sample, the matmul time per measured size (fit_piecewise, with `breaks`)."""
    n, s = np.asarray(ns, float), np.asarray(starts, float)
    features = np.stack([np.ones_like(n), n, n * (s + n)], axis=1)
    a, b, c = _nonneg_lstsq(features, np.asarray(ys, float))
    matmul = fit_piecewise(n.tolist(), (np.asarray(ys, float) - c * n * (s + n)).tolist(), breaks)
    return ChunkCost(float(a), float(b), float(c), matmul)


def fit_decode(rows: Sequence[int], positions: Sequence[int], ys: Sequence[float]) -> DecodeCost:
    """A line in positions for each measured batch size, then each coefficient made
    non-decreasing in the batch size."""
    by_rows: dict[int, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for b, t, y in zip(rows, positions, ys, strict=True):
        by_rows[int(b)][0].append(float(t))
        by_rows[int(b)][1].append(float(y))
    knots = sorted(by_rows)
    lines = [fit_linear(*by_rows[b]) for b in knots]
    xs = tuple(float(b) for b in knots)
    base = nondecreasing([ln.fixed_s for ln in lines])
    per_position = nondecreasing([ln.per_unit_s for ln in lines])
    return DecodeCost(PiecewiseLinear(xs, tuple(base)), PiecewiseLinear(xs, tuple(per_position)))
