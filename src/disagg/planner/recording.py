"""What a real `DecodeEngine` step ran, written down as the simulator's `StepWork`.

`Recorder(engine)` wraps the engine's model and KV cache: every call still goes through to
the real one and is also recorded as (kind, a, b) in decode_sim's terms. The profiler uses
it to cost a measured chunk-plus-decode step part by part (profile.mixed_factor); the
mirror test uses it to hold decode_sim.SimDecodeEngine to the real engine's steps. No torch
import here: arguments are read by duck typing (lists, tensors, arrays alike).
"""

from __future__ import annotations

from typing import Any

from disagg.planner.decode_sim import CHUNK, DECODE, KV_MOVE, KV_WRITE, PREFILL, StepWork


class _Model:
    def __init__(self, inner: Any, rec: Recorder) -> None:
        self._inner, self._rec = inner, rec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prefill(self, token_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        self._rec.work.add(PREFILL, len(token_ids))
        return self._inner.prefill(token_ids, *args, **kwargs)

    def prefill_chunk(self, token_ids: list[int], start: int, *args: Any, **kwargs: Any) -> Any:
        self._rec.work.add(CHUNK, len(token_ids), start)
        return self._inner.prefill_chunk(token_ids, start, *args, **kwargs)

    def prefill_chunks(self, chunks: list[Any], *args: Any, **kwargs: Any) -> Any:
        for c in chunks:  # costed as the chunks one by one (what decode_sim prices)
            self._rec.work.add(CHUNK, len(c.token_ids), c.start)
        return self._inner.prefill_chunks(chunks, *args, **kwargs)

    def decode(self, tokens: Any, positions: Any, *args: Any, **kwargs: Any) -> Any:
        self._rec.work.add(DECODE, len(tokens), int(positions.max()) + 1)
        return self._inner.decode(tokens, positions, *args, **kwargs)


class _Cache:
    def __init__(self, inner: Any, rec: Recorder) -> None:
        self._inner, self._rec = inner, rec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, slot: int, k: Any, v: Any) -> None:
        self._rec.work.add(KV_WRITE, int(k.shape[2]))  # k: [L, H_kv, S, D]
        self._inner.write(slot, k, v)

    def move(self, src: int, dst: int, num_tokens: int) -> None:
        self._rec.work.add(KV_MOVE, num_tokens)
        self._inner.move(src, dst, num_tokens)


class Recorder:
    def __init__(self, engine: Any) -> None:
        """`engine`: a DecodeEngine (its `model` and `cache` are wrapped in place)."""
        self.work = StepWork()
        engine.model = _Model(engine.model, self)
        engine.cache = _Cache(engine.cache, self)

    def take(self) -> StepWork:
        """The work recorded since the last take."""
        work, self.work = self.work, StepWork()
        return work
