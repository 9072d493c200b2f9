"""Client of one external OpenAI-compatible endpoint (Groq's API by default): streaming chat
completions over SSE, with the timeouts, error kinds, rate-limit headers and breaker updates
the router needs. Standard library only: it runs inside Triton's Python backend stub.

Timeouts: `connect_timeout_s` to open the connection, `first_token_timeout_s` from sending
the request to the first content, `idle_timeout_s` between chunks after that, and
`total_timeout_s` for the whole call. The API key is read per call and never logged: any
text that could carry it (an error body) is redacted first.
"""

from __future__ import annotations

import enum
import glob
import http.client
import importlib.util
import json
import sys
import time
import urllib.parse
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from disagg.errors import DisaggError
from disagg.routing.health import CircuitBreaker, RateLimits
from disagg.routing.policy import EndpointConfig


def _import_ssl() -> ModuleType:
    """`ssl`, also inside a Triton Python backend stub built on an older libpython than the
    stdlib it imports. nvidia-pytriton's stub embeds the system libpython (Debian's 3.11.2)
    but imports the venv's standard library (pyenv's 3.11.7 here), whose `_ssl` needs a symbol
    added in 3.11.5 (`_PyModule_Add`). The system's own `_ssl`, built for that libpython, is
    loaded in its place."""
    try:
        import ssl

        return ssl
    except ImportError:
        v = sys.version_info
        found = glob.glob(f"/usr/lib/python{v.major}.{v.minor}/lib-dynload/_ssl.cpython-*.so")
        if not found:
            raise
        spec = importlib.util.spec_from_file_location("_ssl", found[0])
        if spec is None or spec.loader is None:
            raise
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_ssl"] = module
        sys.modules.pop("ssl", None)
        import ssl

        return ssl


if TYPE_CHECKING:
    import ssl
else:
    ssl = _import_ssl()


class _TLSConnection(http.client.HTTPConnection):
    """HTTPS without `http.client.HTTPSConnection`, which is missing when `http.client` was
    imported before `ssl` could be (see `_import_ssl`)."""

    default_port = 443

    def __init__(self, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._context = ssl.create_default_context()  # verifies certificates and host name

    def connect(self) -> None:
        super().connect()
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host)


class ErrorKind(enum.StrEnum):
    """How an endpoint call failed (EndpointError.kind; metric label values)."""

    RATE_LIMITED = "rate_limited"  # 429
    CAPACITY = "capacity"  # 498: the provider's capacity is exhausted
    SERVER_ERROR = "server_error"  # 5xx, or an error event inside the stream
    REJECTED = "rejected"  # 400/413/422: this request, not the endpoint
    AUTH = "auth"  # 401/403/404: key or model misconfigured
    TIMEOUT = "timeout"
    CONNECTION = "connection"  # refused, reset, cut mid-stream
    PROTOCOL = "protocol"  # not SSE, malformed JSON, no finish


RATE_LIMITED, CAPACITY, SERVER_ERROR, REJECTED = (
    ErrorKind.RATE_LIMITED, ErrorKind.CAPACITY, ErrorKind.SERVER_ERROR, ErrorKind.REJECTED,
)  # fmt: skip
AUTH, TIMEOUT, CONNECTION, PROTOCOL = (
    ErrorKind.AUTH, ErrorKind.TIMEOUT, ErrorKind.CONNECTION, ErrorKind.PROTOCOL,
)  # fmt: skip
# kinds that say the endpoint is unhealthy (they count towards opening its circuit)
BREAKER_KINDS = {SERVER_ERROR, AUTH, TIMEOUT, CONNECTION, PROTOCOL}
MAX_ERROR_BODY = 2048


class Unavailable(enum.StrEnum):
    """Why an endpoint cannot take a request now (`unavailable_reason`): the router's
    route_reason when it falls back, and the fallback metric's label."""

    MODEL_NOT_MAPPED = "model_not_mapped"  # the endpoint serves no such public model
    NO_CREDENTIALS = "no_credentials"  # its API key is not set
    RATE_LIMITED = "rate_limited"  # its request or token budget is spent for now
    CIRCUIT_OPEN = "circuit_open"  # it failed repeatedly; waiting out its cooldown


class EndpointError(DisaggError):
    def __init__(self, kind: ErrorKind, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


@dataclass(frozen=True)
class ChatRequest:
    """What is sent: the OpenAI chat-completions fields disagg can map faithfully."""

    messages: list[dict[str, Any]]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    response_format: dict[str, Any] | None = None  # a JSON guide (json_object, json_schema)
    # the client's tools, served natively: "tools", "tool_choice", "parallel_tool_calls"
    tools: dict[str, Any] | None = None

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": self.messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = list(self.stop)
        if self.response_format is not None:
            body["response_format"] = self.response_format
        if self.tools is not None:
            body.update({k: v for k, v in self.tools.items() if v is not None})
        return body


@dataclass
class StreamEvent:
    text: str = ""  # a content delta
    finish_reason: str | None = None  # on the last event
    usage: dict[str, int] = field(default_factory=dict)  # prompt/completion_tokens, if reported
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's deltas, as sent


def _status_error(status: int, body: str) -> EndpointError:
    if status == 429:
        return EndpointError(RATE_LIMITED, f"rate limited (429): {body}", status)
    if status == 498:
        return EndpointError(CAPACITY, f"over capacity (498): {body}", status)
    if status >= 500:
        return EndpointError(SERVER_ERROR, f"server error ({status}): {body}", status)
    if status in (401, 403, 404):
        return EndpointError(AUTH, f"refused ({status}): {body}", status)
    return EndpointError(REJECTED, f"request refused ({status}): {body}", status)


def _is_call_delta(delta: object) -> bool:
    """An OpenAI tool-call delta: an index, and strings where it has an id or a function."""
    if not isinstance(delta, dict) or not isinstance(delta.get("index"), int):
        return False
    fn = delta.get("function") or {}
    return (
        isinstance(fn, dict)
        and all(isinstance(fn.get(k) or "", str) for k in ("name", "arguments"))
        and isinstance(delta.get("id") or "", str)
    )


class OpenAIEndpoint:
    def __init__(self, config: EndpointConfig) -> None:
        self.config = config
        self.name = config.name
        self.breaker = CircuitBreaker(config.failure_threshold, config.cooldown_s)
        self.limits = RateLimits()
        url = urllib.parse.urlsplit(config.base_url)
        self._https = url.scheme == "https"
        self._host = url.hostname or ""
        self._port = url.port or (443 if self._https else 80)
        self._path = url.path.rstrip("/") + "/chat/completions"

    def model_for(self, public_model: str) -> str | None:
        """The endpoint's name for a public model; with no mapping, the name passes as is."""
        if not self.config.models:
            return public_model
        return self.config.models.get(public_model)

    def unavailable_reason(self, public_model: str, est_tokens: int) -> Unavailable | None:
        """Why this endpoint cannot take a request now, or None (and, when its circuit is
        half-open, this request becomes the probe)."""
        if self.model_for(public_model) is None:
            return Unavailable.MODEL_NOT_MAPPED
        if self.config.api_key() is None:
            return Unavailable.NO_CREDENTIALS
        if not self.limits.can_send(est_tokens):
            return Unavailable.RATE_LIMITED
        if not self.breaker.allow():
            return Unavailable.CIRCUIT_OPEN
        return None

    def stream_chat(
        self, public_model: str, req: ChatRequest
    ) -> Generator[StreamEvent, None, None]:
        """Content deltas, then one event with the finish reason (and usage). Raises
        EndpointError; closing the generator early (a cancelled request) closes the call."""
        key = self.config.api_key() or ""
        succeeded, failed = False, None  # failed: the EndpointError's kind
        try:
            yield from self._stream(key, self.model_for(public_model) or public_model, req)
            succeeded = True
        except EndpointError as e:
            failed = e.kind
            if key:
                e.args = (str(e).replace(key, "***"),)
            raise
        finally:
            if succeeded:
                self.breaker.record_success()
            elif failed in BREAKER_KINDS:
                self.breaker.record_failure()
            else:  # cancelled, or a budget answer (429/498) that says nothing about health
                self.breaker.release()

    def _connect(self) -> http.client.HTTPConnection:
        timeout = self.config.connect_timeout_s
        kind = _TLSConnection if self._https else http.client.HTTPConnection
        conn = kind(self._host, self._port, timeout=timeout)
        try:
            conn.connect()
        except TimeoutError:
            raise EndpointError(TIMEOUT, f"connect timed out after {timeout:g} s") from None
        except OSError as e:  # refused, unreachable, TLS handshake or certificate failure
            raise EndpointError(CONNECTION, f"cannot connect: {e}") from None
        return conn

    def _stream(self, key: str, model: str, req: ChatRequest) -> Iterator[StreamEvent]:
        cfg = self.config
        start = time.monotonic()
        deadline = start + cfg.total_timeout_s
        conn = self._connect()
        sock = conn.sock  # kept: the connection lets go of it once a response says "close"
        got_content = False

        def arm() -> str:
            """Set the socket timeout for the next read; returns what a timeout would mean."""
            left = deadline - time.monotonic()
            wait, what = (
                (cfg.idle_timeout_s, f"stream idle for {cfg.idle_timeout_s:g} s")
                if got_content
                else (
                    start + cfg.first_token_timeout_s - time.monotonic(),
                    f"no first token within {cfg.first_token_timeout_s:g} s",
                )
            )
            if left <= wait:
                wait, what = left, f"total timeout of {cfg.total_timeout_s:g} s"
            if wait <= 0:
                raise EndpointError(TIMEOUT, what)
            sock.settimeout(wait)
            return what

        try:
            what = arm()
            try:
                conn.request(
                    "POST",
                    self._path,
                    body=json.dumps(req.body(model)).encode(),
                    headers={
                        "Authorization": f"Bearer {key}",
                        "Content-Type": "application/json",
                        "Accept": "text/event-stream",
                        "User-Agent": "disagg-router",
                    },
                )
                resp = conn.getresponse()
            except TimeoutError:
                raise EndpointError(TIMEOUT, what) from None
            except (OSError, http.client.HTTPException) as e:
                raise EndpointError(CONNECTION, f"request failed: {e}") from None
            self.limits.update(dict(resp.getheaders()))
            if resp.status != 200:
                body = self._error_body(resp)
                if resp.status == 498 and resp.getheader("retry-after") is None:
                    self.limits.block_for(cfg.capacity_backoff_s)
                elif resp.status == 429 and resp.getheader("retry-after") is None:
                    self.limits.block_for(1.0)
                raise _status_error(resp.status, body)
            ctype = resp.getheader("content-type", "")
            if "text/event-stream" not in ctype:
                raise EndpointError(PROTOCOL, f"expected an SSE stream, got {ctype!r}")
            finish: str | None = None
            usage: dict[str, int] = {}
            while True:
                what = arm()
                try:
                    raw = resp.readline(65536)
                except TimeoutError:
                    raise EndpointError(TIMEOUT, what) from None
                except (OSError, http.client.HTTPException) as e:
                    raise EndpointError(CONNECTION, f"stream broken: {e}") from None
                if not raw:  # connection closed
                    if finish is None:
                        raise EndpointError(CONNECTION, "stream ended before a finish reason")
                    break
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments (":"), event:/id:/retry: fields
                data = line[5:].strip()
                if data == "[DONE]":
                    if finish is None:
                        raise EndpointError(PROTOCOL, "stream finished without a finish reason")
                    break
                event = self._parse_chunk(data)
                usage = event.usage or usage
                finish = event.finish_reason or finish
                if event.text or event.tool_calls:
                    got_content = True
                    yield StreamEvent(text=event.text, tool_calls=event.tool_calls)
            yield StreamEvent(finish_reason=finish, usage=usage)
        finally:
            conn.close()

    @staticmethod
    def _parse_chunk(data: str) -> StreamEvent:
        try:
            chunk = json.loads(data)
        except ValueError:
            raise EndpointError(PROTOCOL, f"malformed SSE data: {data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise EndpointError(PROTOCOL, f"malformed SSE data: {data[:200]!r}")
        if "error" in chunk:
            err = chunk["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise EndpointError(SERVER_ERROR, f"error in stream: {msg}")
        usage = chunk.get("usage") or (chunk.get("x_groq") or {}).get("usage") or {}
        choices = chunk.get("choices") or []
        if not choices:
            return StreamEvent(usage=usage if isinstance(usage, dict) else {})
        try:
            choice = choices[0]
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            calls = delta.get("tool_calls") or []
            if not isinstance(text, str):
                raise TypeError(type(text).__name__)
            if not isinstance(calls, list) or not all(_is_call_delta(c) for c in calls):
                raise TypeError("tool_calls is not a list of tool-call deltas")
        except (AttributeError, TypeError) as e:
            raise EndpointError(PROTOCOL, f"malformed chunk ({e}): {data[:200]!r}") from None
        return StreamEvent(text, choice.get("finish_reason"), usage, calls)

    @staticmethod
    def _error_body(resp: http.client.HTTPResponse) -> str:
        try:
            raw = resp.read(MAX_ERROR_BODY)
        except (OSError, http.client.HTTPException):
            return "(no body)"
        text = raw.decode("utf-8", errors="replace")
        try:
            err = json.loads(text).get("error", text)
            return str(err.get("message", err) if isinstance(err, dict) else err)
        except (ValueError, AttributeError):
            return text.strip()[:300] or "(no body)"
