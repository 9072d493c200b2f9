"""A streamed reply split into content and OpenAI's tool-call deltas (in the request's tool
format: tools.py): the streaming half of tools.py's parse_reply."""

from __future__ import annotations

import json
from typing import Any

from disagg.gateway.tools import ToolCall, Tools, block_end, parse_call

JSON = dict[str, Any]


class ToolStream:
    """A streamed reply split into content deltas and tool calls, as OpenAI streams them:
    text is passed on until a `<tool_call>` may be starting (a possible beginning is held
    back); in a block, the call's id and name go out once the name is complete and the
    arguments have begun, then the arguments as they grow (until the arguments' value is
    whole; while it is not, what may be its closing brace held back), the rest when the
    block closes (its first CLOSE after a whole JSON body: tools.block_end). A block that
    does not parse or writes "arguments" before "name" goes out whole when it closes, or as
    content at the end when it never does. One whose name went out is a call from then on
    (finish_reason tool_calls, the next call at the next index), even when its arguments
    end broken: cut by max_tokens, or not JSON (possible only with tool_choice auto:
    required and named calls are decoded under a grammar)."""

    def __init__(self, tools: Tools) -> None:
        self.tools, self.fmt = tools, tools.fmt
        self.pending = ""  # held back: a possible beginning of a block, or an open block
        self.calls: list[ToolCall] = []
        self.in_block = False
        self.head: ToolCall | None = None  # the open block's call, once its name went out
        self.args_at = 0  # where its arguments begin in `pending`
        self.args_sent = 0  # characters of them already sent

    def feed(self, text: str) -> tuple[str, list[JSON]]:
        """-> (content to send now, tool-call deltas to send now)."""
        self.pending += text
        content, deltas = "", list[JSON]()
        while True:
            if not self.in_block:
                at = self.pending.find(self.fmt.OPEN)
                if at < 0:
                    keep = _possible_start(self.pending, self.fmt.OPEN)
                    cut = len(self.pending) - keep
                    if not self.calls:  # text after a call is dropped, as parse_reply does
                        content += self.pending[:cut]
                    self.pending = self.pending[cut:]
                    return content, deltas
                if not self.calls:
                    content += self.pending[:at]
                self.pending, self.in_block = self.pending[at:], True
            end = block_end(self.pending, len(self.fmt.OPEN), self.fmt)
            if end is None:
                deltas += self._open_block()
                return content, deltas
            closed, was_call = self._close_block(end)
            deltas += closed
            if not was_call and not self.calls:  # not a call after all: it is text
                content += self.pending[: end + len(self.fmt.CLOSE)]
            self.head = None
            self.pending, self.in_block = self.pending[end + len(self.fmt.CLOSE) :], False

    def _open_block(self) -> list[JSON]:
        """Deltas of the open block so far: its head once the name is known, then the
        arguments written since, less a tail that may be the block's closing brace."""
        out: list[JSON] = []
        if self.head is None:
            pattern = self.fmt.HEAD
            m = pattern.match(self.pending, len(self.fmt.OPEN)) if pattern else None
            if m is None or m.group(1) not in self.tools.names:
                return out
            self.head, self.args_at, self.args_sent = ToolCall(m.group(1), ""), m.end(), 0
            self.calls.append(self.head)  # a call from now on, whatever follows
            head = self.head.as_json(len(self.calls) - 1)
            out.append({**head, "function": {"name": self.head.name, "arguments": ""}})
        args = self.pending[self.args_at :]
        try:  # the arguments' value whole: exactly it, nothing the block writes after it
            ready = json.JSONDecoder().raw_decode(args)[1]
        except ValueError:
            keep = _possible_start(args, self.fmt.CLOSE)
            ready = len(args[: len(args) - keep].rstrip(" \t\n}"))
        if ready > self.args_sent:
            piece = args[self.args_sent : ready]
            out.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
            self.args_sent = ready
            self.head.arguments = args[:ready]
        return out

    def _close_block(self, end: int) -> tuple[list[JSON], bool]:
        """Deltas that complete the block closing at `end` (its call recorded), and whether
        it was a call (False: it is text)."""
        out: list[JSON] = []
        call = parse_call(self.pending[len(self.fmt.OPEN) : end], self.tools)
        if self.head is None:
            if call is not None:
                i = len(self.calls)
                head = {**call.as_json(i), "function": {"name": call.name, "arguments": ""}}
                out += [head, {"index": i, "function": {"arguments": call.arguments}}]
                self.calls.append(call)
            return out, call is not None
        if call is None or call.name != self.head.name:
            return out, True  # (its head went out: the client has a call, arguments broken)
        sent = self.head.arguments
        if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
            rest = call.arguments[len(sent) :]
            out.append({"index": len(self.calls) - 1, "function": {"arguments": rest}})
        self.head.arguments = call.arguments
        return out, True

    def finish(self) -> str:
        """Content still held back (an unclosed block, a partial tag), if no call was made
        (a block whose name went out is one)."""
        rest, self.pending = self.pending, ""
        return "" if self.calls else rest


def _possible_start(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
