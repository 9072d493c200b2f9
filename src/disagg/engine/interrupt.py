"""A prefill's cancellation point: `Stop`, a check asked before each layer of a prefill, and
the loop over the layers that asks it. Why between layers: engine/prefill_engine.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from disagg.errors import RequestCancelledError

T = TypeVar("T")
Stop = Callable[[], bool] | None  # True: the request's client went away; None: never asked


def until_stopped(layers: Sequence[T], stop: Stop) -> Iterator[tuple[int, T]]:
    """enumerate(layers), asking `stop` before each; True raises RequestCancelledError."""
    for i, layer in enumerate(layers):
        if stop is not None and stop():
            raise RequestCancelledError("prefill cancelled: the request's client went away")
        yield i, layer
