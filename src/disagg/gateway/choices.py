"""`n` > 1: several choices for one prompt, whole or streamed (OpenAI's shapes: one response
with `choices[i]`, or chunks each naming its choice's `index`).

Each choice is its own request to the router, but the prompt is prefilled once: the first
choice is sent alone, and the others only once its first response arrived, when the
prompt's full KV blocks are in the prefix caches of the pools that served it; the others
then compute only what no full block holds (under one block, 16 tokens by default) and
share the rest, as vLLM's n sequences share their prompt's blocks. A request with
`use_prefix_cache: false` prefills each choice itself. With a `seed`, choice i samples with
seed + i: each is reproducible and they differ. Usage counts the prompt once and every
choice's completion tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from disagg import contracts as C
from disagg.gateway import openai_api as oa
from disagg.gateway.backend import Piece
from disagg.gateway.call import Call
from disagg.gateway.choice_stream import ChoiceStream, Whole, collect
from disagg.gateway.errors import APIError

log = logging.getLogger("disagg.gateway")
Pieces = AsyncGenerator[Piece, None]


def choice_inputs(req: oa.GenRequest, i: int) -> dict[str, Any]:
    inputs = dict(req.inputs)
    if i and C.SEED in inputs:
        inputs[C.SEED] = (int(inputs[C.SEED]) + i) % 2**63  # type: ignore[call-overload]
    return inputs


async def _prepend(first: Piece, rest: Pieces) -> Pieces:
    try:
        yield first
        async for piece in rest:
            yield piece
    finally:
        await rest.aclose()


def open_choices(call: Call, first: Piece, start: Any) -> list[Pieces]:
    """Choice 0 already answered `first`; start the others (`start(request_id, inputs)`)."""
    req = call.req
    assert req is not None and call.pieces is not None, "set by _serve"
    others = [start(f"{call.rid}-{i}", choice_inputs(req, i)) for i in range(1, req.n)]
    return [_prepend(first, call.pieces), *others]


async def close_all(streams: list[Pieces]) -> None:
    for s in streams:
        with contextlib.suppress(Exception):
            await s.aclose()


async def collect_all(call: Call, streams: list[Pieces]) -> list[Whole] | None:
    """Every choice read to its end; None if the client went away meanwhile."""
    tasks = [asyncio.ensure_future(collect(s)) for s in streams]
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.done() and t.exception() is not None for t in tasks):
                break
            if not all(t.done() for t in tasks) and await call.request.is_disconnected():
                log.info("request %s: client disconnected; cancelling", call.rid)
                return None
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        await close_all(streams)
    out = []
    for t in tasks:
        whole = t.result()  # (raises the first choice's error, an APIError)
        if whole.last is None or whole.last.finish_reason is None:
            raise APIError(502, "the model ended without a finish reason", "server_error")
        out.append(whole)
    return out


def whole_response(call: Call, results: list[Whole]) -> dict[str, Any]:
    """Usage counts the prompt once and every choice's completion tokens."""
    req = call.req
    assert req is not None
    first = results[0].last
    assert first is not None
    n_out = sum(w.last.num_output_tokens for w in results if w.last is not None)
    use = oa.usage(first.num_input_tokens, n_out, first.num_cached_tokens)
    choices = [w.choice(req, i) for i, w in enumerate(results)]
    return oa.whole_body(req, call.rid, call.fingerprint, choices, use)


async def stream_events(call: Call, streams: list[Pieces]) -> AsyncIterator[bytes]:
    """The SSE events of every choice, interleaved as they come, then usage and [DONE]."""
    req, rid, fp = call.req, call.rid, call.fingerprint
    assert req is not None
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, pieces: Pieces) -> None:
        try:
            async for piece in pieces:
                await queue.put((i, piece))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which reports it
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    per_choice = [ChoiceStream(req, rid, fp) for _ in streams]
    n_out = [0] * len(streams)
    n_in = n_cached = 0
    try:
        if req.kind == "chat":
            for i in range(len(streams)):
                yield oa.sse(_indexed(oa.chunk(req, rid, fp, role=True), i))
        open_ = len(streams)
        while open_:
            i, item = await queue.get()
            if item is None:
                open_ -= 1
                continue
            if isinstance(item, APIError):
                raise item
            if isinstance(item, BaseException):
                raise APIError(502, "the model failed", "server_error") from item
            piece = item
            n_out[i] = piece.num_output_tokens
            if i == 0:
                n_in, n_cached = piece.num_input_tokens, piece.num_cached_tokens
            call.n_in, call.n_out = n_in, sum(n_out)
            if piece.finish_reason == C.FINISH_ERROR:
                raise APIError(502, piece.extra.get(C.ERROR) or "the model failed", "server_error")
            for chunk in per_choice[i].chunks(piece):
                yield oa.sse(_indexed(chunk, i))
        if req.include_usage:
            yield oa.sse(oa.usage_chunk(req, rid, fp, n_in, sum(n_out), n_cached))
        call.status = 200
        yield oa.sse("[DONE]")
    except APIError as e:
        call.status = e.status
        yield oa.sse(e.body())
    finally:
        for t in tasks:
            t.cancel()
        await close_all(streams)


def _indexed(chunk: dict[str, Any], i: int) -> dict[str, Any]:
    chunk["choices"][0]["index"] = i
    return chunk
