"""One choice's pieces (the router's responses) -> OpenAI's shapes: collected whole, or as
stream chunks. Shared by the single-choice path (openai_routes.py) and n > 1 (choices.py),
so both split tool calls, carry logprobs and map finish reasons alike."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from disagg.gateway import openai_api as oa
from disagg.gateway.backend import Piece
from disagg.gateway.tool_stream import ToolStream
from disagg.tool_deltas import merged

JSON = dict[str, Any]


@dataclass
class Whole:
    """A choice read to its end."""

    text: str
    last: Piece | None  # None: the stream ended without a response
    logprobs: list[JSON] | None  # every token's, when asked for
    tool_calls: list[JSON] | None = None  # an endpoint's tool-call deltas, as relayed

    def choice(self, req: oa.GenRequest, index: int = 0) -> JSON:
        assert self.last is not None
        finish = self.last.finish_reason or ""
        calls = merged(self.tool_calls) if self.tool_calls else None
        return oa.whole_choice(req, self.text, finish, self.logprobs, index, calls)


async def collect(pieces: AsyncIterator[Piece]) -> Whole:
    text, last = "", None
    logprobs: list[JSON] | None = None
    calls: list[JSON] = []
    async for piece in pieces:
        text += piece.text
        if piece.logprobs is not None:  # (None until a piece carries some: not asked for)
            logprobs = [] if logprobs is None else logprobs
            logprobs.extend(piece.logprobs)
        calls += piece.tool_calls or []
        last = piece
    return Whole(text, last, logprobs, calls or None)


class ChoiceStream:
    """One choice's stream chunks: its text (tool calls split out, a tag's beginning held
    back until it is known), its tokens' logprobs, and its finish reason."""

    def __init__(self, req: oa.GenRequest, rid: str, fingerprint: str) -> None:
        self.req, self.rid, self.fingerprint = req, rid, fingerprint
        self.tools = ToolStream(req.tools) if req.tools is not None else None
        self.offset = 0  # characters of text before the next token (completions' text_offset)
        self.relayed = False  # an endpoint's tool calls went out

    def chunks(self, piece: Piece) -> list[JSON]:
        req = self.req
        text, calls = piece.text, None
        if self.tools is not None:
            text, calls = self.tools.feed(piece.text)
            if piece.finish_reason is not None:
                text += self.tools.finish()
        if piece.tool_calls:  # an endpoint's, in OpenAI's shape already
            calls, self.relayed = (calls or []) + piece.tool_calls, True
        logprobs = None
        if req.logprobs and piece.logprobs:
            logprobs = oa.choice_logprobs(req, piece.logprobs, self.offset)
            self.offset += sum(len(t["token"]) for t in piece.logprobs)
        out = []
        if text or calls or logprobs:
            out.append(
                oa.chunk(
                    req,
                    self.rid,
                    self.fingerprint,
                    text=text if text or logprobs else None,
                    tool_calls=calls,
                    logprobs=logprobs,
                )
            )
        if piece.finish_reason is not None:
            finish = piece.finish_reason
            if (self.relayed or (self.tools is not None and self.tools.calls)) and finish == "stop":
                finish = oa.TOOL_CALLS
            out.append(oa.chunk(req, self.rid, self.fingerprint, finish=finish))
        return out
