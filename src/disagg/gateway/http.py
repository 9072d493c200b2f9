"""HTTP plumbing of the gateway's routes: request heads bounded (431), request ids, bodies
read safely (size, time, UTF-8, depth, lone surrogates), errors answered in OpenAI's format,
client text made safe to log, and a streamed reply whose bookkeeping runs however it ends."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

import h11
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import ContentStream, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from disagg.contracts import REQUEST_ID_HEADER, client_request_id, new_request_id
from disagg.gateway.errors import APIError, bad_request

# ------------------------------------------------------------------ request heads
# A client's request line and headers are held in memory whole before any route runs; without
# a bound a 100 KB header was accepted. 16 KiB in all and 8 KiB a line, as nginx's
# large_client_header_buffers (4 x 8k) and Node's 16 KiB: an API key, a cookie or a trace
# header fits many times over.
MAX_HEAD_BYTES = 16 * 1024  # request line + every header line (name, ": ", value, CRLF)
MAX_HEADER_LINE_BYTES = 8 * 1024  # one header line


def head_excess(method: str, target: bytes, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why a request head is too large to serve, or None when it is within the limits."""
    total = len(method) + len(target) + len(" HTTP/1.1\r\n")
    for name, value in headers:
        line = len(name) + 2 + len(value) + 2
        if line > MAX_HEADER_LINE_BYTES:
            return f"a header line is {line} bytes, over {MAX_HEADER_LINE_BYTES}"
        total += line
    if total > MAX_HEAD_BYTES:
        return f"the request line and headers are {total} bytes, over {MAX_HEAD_BYTES}"
    return None


def _too_large(why: str) -> APIError:
    return APIError(
        431, why, code="request_header_fields_too_large", headers={"connection": "close"}
    )


class HeadLimit:
    """ASGI middleware: a request whose head h11 parsed whole but is over the limits gets a
    431 before any route runs (h11 bounds only a head still arriving; one that came in one
    read, up to asyncio's 256 KiB, passed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            target = (scope.get("raw_path") or b"") + b"?" + scope.get("query_string", b"")
            why = head_excess(scope["method"], target, scope["headers"])
            if why is not None:
                await _too_large(why).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class H11HeadLimit(H11Protocol):
    """uvicorn's h11 protocol, with h11's own refusal of a head that is still arriving past
    `h11_max_incomplete_event_size` (set to MAX_HEAD_BYTES) answered 431, as h11's
    error_status_hint says, instead of uvicorn's generic 400. `send_400_response` is the one
    place uvicorn (0.54, h11_impl.py `handle_events`) answers a RemoteProtocolError."""

    def send_400_response(self, msg: str) -> None:
        buffered, _ = self.conn.trailing_data  # h11 keeps the bytes it refused
        if len(buffered) <= MAX_HEAD_BYTES:
            super().send_400_response(msg)
            return
        why = f"the request line and headers are over {MAX_HEAD_BYTES} bytes"
        body = json.dumps(_too_large(why).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        reason = b"Request Header Fields Too Large"
        for event in (
            h11.Response(status_code=431, headers=headers, reason=reason),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()


# ------------------------------------------------------------------ logging client text
LOG_TEXT_CHARS = 200  # what a log line repeats of a client's text: enough to recognise it


def loggable(text: str, limit: int = LOG_TEXT_CHARS) -> str:
    """`text` (an error message that may repeat a client's value) fit for one log line: cut
    to `limit` characters, then escaped as repr() escapes (newlines, control and other
    unprintable characters), so a client can neither flood the log nor forge a line in it."""
    shown = repr(text[:limit])[1:-1]
    cut = len(text) - limit
    return shown + (f"... ({cut} more characters)" if cut > 0 else "")


def request_id(request: Request) -> str:
    """The client's x-request-id when safe (contracts.client_request_id), else a new one
    (contracts.new_request_id); the same for every call on one request. The router's own id
    starts with it."""
    rid = getattr(request.state, "disagg_request_id", None)
    if rid is None:
        given = client_request_id(request.headers.get(REQUEST_ID_HEADER, ""))
        rid = request.state.disagg_request_id = given or new_request_id()
    return rid


DRAIN_FACTOR = 16  # an oversized body up to this many times the limit is read and dropped
BODY_TIMEOUT_S = 10.0  # a client has this long to send its whole body (slow or cut-off bodies)


async def read_json(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> object:
    """The body as JSON; over `limit` bytes, a 413. A body somewhat over the limit is read to
    its end (and dropped) before the answer: closing on a client still sending resets the
    connection and the client never sees the 413. A much larger one is cut off. A body that
    does not arrive within `timeout_s` (a client that stops mid-way) gets a 408."""
    try:
        async with asyncio.timeout(timeout_s):
            data = await _read_body(request, limit)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {timeout_s:g} s", code="timeout"
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    _check_unicode(body)
    return body


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = APIError(413, f"request body over {limit} bytes", code="request_too_large")
    size = int(request.headers.get("content-length") or 0)
    if size > limit * DRAIN_FACTOR:
        raise too_large
    data, received = bytearray(), 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit * DRAIN_FACTOR:
            raise too_large
        if received <= limit:
            data += chunk
    if received > limit:
        raise too_large
    return bytes(data)


def _check_unicode(body: object) -> None:
    """JSON's \\uXXXX escapes can spell a lone surrogate ("\\ud800"), which no UTF-8 text
    holds: refuse it here rather than fail when the text is encoded for Triton."""
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(
                    "the request body holds a lone surrogate escape (such as \\ud800): "
                    "not valid Unicode text"
                ) from None


class StreamCounted(StreamingResponse):
    """A streamed reply whose `on_end` runs once it is over, also when its body never started
    (Starlette then never runs the body's finally: a client that left before the first byte
    leaked the in-flight gauge and left its request running)."""

    def __init__(
        self,
        content: ContentStream,
        on_end: Callable[[], Awaitable[None]],
        *,
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
        background: BackgroundTask | None = None,
    ) -> None:
        super().__init__(
            content,
            status_code=status_code,
            headers=headers,
            media_type=media_type,
            background=background,
        )
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_end()


Owner = TypeVar("Owner")  # the class whose method a route is


def answers_errors(
    handler: Callable[[Owner, Request], Awaitable[Response]],
) -> Callable[[Owner, Request], Awaitable[Response]]:
    """A route whose APIErrors become their OpenAI-format response, with the request id."""

    @functools.wraps(handler)
    async def route(self: Owner, request: Request) -> Response:
        try:
            return await handler(self, request)
        except APIError as e:
            return e.response({REQUEST_ID_HEADER: request_id(request)})

    return route
