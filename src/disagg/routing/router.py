r"""The router: one entry point that serves each request on the target its policy and the
endpoints' live state choose. No Triton here (pb.py implements the local pipeline with BLS).

    request --policy--> "openai" target --endpoint 1, 2, ... (skip: circuit open, no budget)
                   \                      | fails before any text reached the client
                    \                     v
                     `----> "triton" target (the local prefill/decode pipeline)

Once text has reached the client, a failing endpoint ends the request with finish reason
"error" (the client has a partial answer; serving it again elsewhere would duplicate it).
A non-streaming request has sent nothing before it ends, so it can always fall back.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from disagg.codec.fields import EXCLUDE_INPUT_DEFAULT
from disagg.contracts import FINISH_ERROR, RoutedReply
from disagg.engine.sequence import FinishReason
from disagg.errors import PoolError
from disagg.routing.endpoint import (
    ChatRequest,
    EndpointError,
    OpenAIEndpoint,
    StreamEvent,
    Unavailable,
)
from disagg.routing.policy import (
    OPENAI,
    EndpointConfig,
    Policy,
    PolicySource,
    RouteFeatures,
    Target,
)
from disagg.tool_deltas import merged

log = logging.getLogger("disagg.router")


class Cause(enum.StrEnum):
    """Why a request planned for endpoints was served by the local pipeline, besides an
    endpoint's own `Unavailable` reason (route_reason, and the fallback metric's label)."""

    UNSUPPORTED_REQUEST = "unsupported_request"  # fields only the local pipeline honours
    ENDPOINT_FAILED = "endpoint_failed"  # an endpoint failed before any text was sent
    ENDPOINTS_UNAVAILABLE = "endpoints_unavailable"  # endpoints out for different causes


@dataclass(frozen=True)
class Fallback:
    """Why the endpoints did not serve a request."""

    cause: Cause | Unavailable
    detail: str = ""  # the endpoint error's kind, or the fields only the local pipeline honours

    def __str__(self) -> str:
        return f"{self.cause}:{self.detail}" if self.detail else str(self.cause)


@dataclass(frozen=True)
class RouteRequest:
    request_id: str  # unique: the local pipeline's cancellation is addressed by it
    features: RouteFeatures
    local_fields: dict[str, Any]  # the client's generation fields plus input_ids: what the
    # local pipeline takes (codec.generate.OrchestratorRequest)
    chat: ChatRequest | None  # what an endpoint gets; None if it cannot be expressed as one
    not_for_endpoints: tuple[str, ...] = ()  # why `chat` is None (fields only local honours)
    prompt_text: str = ""  # echoed when exclude_input_in_output is false (non-streaming)
    stream: bool = False
    exclude_input_in_output: bool = EXCLUDE_INPUT_DEFAULT


class LocalPipeline(Protocol):
    def generate(
        self, model: str, request_id: str, fields: dict[str, Any]
    ) -> Iterator[RoutedReply]:
        """The local pipeline's responses: deltas, then the final one (finish_reason set)."""
        ...

    def cancel(self, request_id: str) -> None: ...


class Endpoint(Protocol):
    """An external endpoint as the router uses it (OpenAIEndpoint; scripted in tests)."""

    name: str
    config: EndpointConfig

    def unavailable_reason(self, public_model: str, est_tokens: int) -> Unavailable | None: ...

    def stream_chat(
        self, public_model: str, req: ChatRequest
    ) -> Generator[StreamEvent, None, None]:
        """Raises EndpointError (with its kind) when the endpoint fails. A generator: the
        router closes it however the request ends (closing it early ends the call)."""
        ...


class RouterEvents:
    """Hooks for metrics; the default does nothing."""

    def decision(self, target: str, reason: str) -> None: ...

    def fallback(self, planned: str, cause: str) -> None: ...

    def endpoint_error(self, endpoint: str, kind: str) -> None: ...

    def retry(self, endpoint: str) -> None:
        """A request passed on to `endpoint` after an earlier endpoint of its pool failed."""


class Router:
    def __init__(
        self,
        policy: PolicySource,
        local: LocalPipeline,
        count_tokens: Callable[[str], int],
        events: RouterEvents | None = None,
        endpoint_factory: Callable[[EndpointConfig], Endpoint] = OpenAIEndpoint,
    ) -> None:
        self.policy = policy
        self.local = local
        self.count_tokens = count_tokens  # usage for endpoints that do not report it
        self.events = events or RouterEvents()
        self.endpoint_factory = endpoint_factory
        self._endpoints: dict[str, Endpoint] = {}
        self._lock = threading.Lock()

    def endpoint(self, policy: Policy, name: str) -> Endpoint:
        """Endpoint state lives across requests; a reloaded policy that changes an endpoint's
        settings starts it afresh."""
        config = policy.endpoints[name]
        with self._lock:
            ep = self._endpoints.get(name)
            if ep is None or ep.config != config:
                ep = self._endpoints[name] = self.endpoint_factory(config)
            return ep

    def run(
        self,
        req: RouteRequest,
        emit: Callable[[RoutedReply], None],
        is_cancelled: Callable[[], bool] = lambda: False,
    ) -> RoutedReply:
        policy = self.policy.current()
        planned, reason = policy.route(req.features)
        target = policy.targets[planned]
        if target.kind == OPENAI:
            why = self._why_not_endpoints(req)
            if why is None:
                served = self._try_endpoints(policy, target, req, emit, is_cancelled)
                if isinstance(served, RoutedReply):
                    return self._done(req, served, planned, reason)
                why = served
            local = policy.fallback_for(planned)
            log.info(
                "request %s: %s (rule %s) unavailable: %s; served by %s",
                req.request_id, planned, reason, why, local.name,
            )  # fmt: skip
            self.events.fallback(planned, str(why.cause))
            target, reason = local, str(why.cause)
        reply = self._serve_local(target, req, emit, is_cancelled)
        return self._done(req, reply, target.name, reason)

    def _done(self, req: RouteRequest, reply: RoutedReply, target: str, reason: str) -> RoutedReply:
        reply.target, reply.reason = target, reason
        self.events.decision(target, reason)
        log.info(
            "request %s routed: target=%s reason=%s served_by=%s finish=%s",
            req.request_id, target, reason, reply.served_by, reply.finish_reason,
        )  # fmt: skip
        return reply

    @staticmethod
    def _why_not_endpoints(req: RouteRequest) -> Fallback | None:
        if req.chat is None:
            return Fallback(Cause.UNSUPPORTED_REQUEST, ",".join(req.not_for_endpoints))
        return None

    def _try_endpoints(
        self,
        policy: Policy,
        target: Target,
        req: RouteRequest,
        emit: Callable[[RoutedReply], None],
        is_cancelled: Callable[[], bool],
    ) -> RoutedReply | Fallback:
        """The reply of the first endpoint that serves the request, else why none did."""
        causes: list[Fallback] = []
        est_tokens = req.features.prompt_tokens + req.features.max_tokens
        for name in target.endpoints:
            ep = self.endpoint(policy, name)
            why = ep.unavailable_reason(req.features.model, est_tokens)
            if why is not None:
                causes.append(Fallback(why))
                continue
            if any(c.cause is Cause.ENDPOINT_FAILED for c in causes):
                self.events.retry(name)
            try:
                return self._serve_endpoint(ep, req, emit, is_cancelled)
            except EndpointError as e:
                self.events.endpoint_error(name, e.kind)
                log.warning("request %s: endpoint %s failed: %s", req.request_id, name, e)
                causes.append(Fallback(Cause.ENDPOINT_FAILED, e.kind))
        return causes[0] if len(set(causes)) == 1 else Fallback(Cause.ENDPOINTS_UNAVAILABLE)

    def _serve_endpoint(
        self,
        ep: Endpoint,
        req: RouteRequest,
        emit: Callable[[RoutedReply], None],
        is_cancelled: Callable[[], bool],
    ) -> RoutedReply:
        """Raises EndpointError only while nothing has been sent to the client."""
        assert req.chat is not None
        out = RoutedReply("", req.features.prompt_tokens, served_by=ep.name)
        text, sent, usage = "", False, {}
        calls: list[dict[str, Any]] = []  # the tool-call deltas so far (a whole reply's)
        events = ep.stream_chat(req.features.model, req.chat)
        try:
            for ev in events:
                if is_cancelled():
                    out.finish_reason = FinishReason.ABORT.value
                    break
                if ev.text or ev.tool_calls:
                    text += ev.text
                    out.num_output_tokens += 1  # chunks until usage says otherwise
                    calls += ev.tool_calls
                    if req.stream:
                        delta = RoutedReply(ev.text, out.num_input_tokens, out.num_output_tokens)
                        delta.tool_calls = ev.tool_calls or None
                        emit(delta)
                        sent = True
                if ev.finish_reason is not None:
                    out.finish_reason, usage = ev.finish_reason, ev.usage
        except EndpointError as e:
            if not sent:
                raise
            log.warning("request %s: %s failed mid-stream: %s", req.request_id, ep.name, e)
            self.events.endpoint_error(ep.name, e.kind)
            out.finish_reason, out.error = FINISH_ERROR, f"endpoint {ep.name} failed: {e}"
        finally:
            events.close()
        out.num_input_tokens = int(usage.get("prompt_tokens", out.num_input_tokens))
        out.num_output_tokens = int(usage.get("completion_tokens", 0)) or self.count_tokens(text)
        if req.stream:
            out.text = ""
        else:
            out.text = text if req.exclude_input_in_output else req.prompt_text + text
            out.tool_calls = merged(calls) or None
        return out

    def _serve_local(
        self,
        target: Target,
        req: RouteRequest,
        emit: Callable[[RoutedReply], None],
        is_cancelled: Callable[[], bool],
    ) -> RoutedReply:
        final: RoutedReply | None = None
        cancelled = False
        for reply in self.local.generate(target.model, req.request_id, req.local_fields):
            if reply.finish_reason is not None:
                final = reply
            elif not cancelled:
                emit(reply)
            if not cancelled and is_cancelled():
                cancelled = True
                self.local.cancel(req.request_id)
        if final is None:
            raise PoolError(f"{target.model} ended without a final response")
        return final
