"""The OpenAI routes: /v1/models, /v1/chat/completions, /v1/completions (JSON and SSE).

A generation request is authenticated, admitted by its key's limits, parsed
(openai_api.parse_request), resolved to a model version (registry.py), and streamed from
Triton's `router` (backend.py). One `Call` carries it through; errors before any output are
HTTP errors, errors after the stream began are its last SSE event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from disagg import contracts as C
from disagg.contracts import REQUEST_ID_HEADER
from disagg.gateway import choices
from disagg.gateway import openai_api as oa
from disagg.gateway.auth import KeyStore, RateLimiter
from disagg.gateway.backend import Piece, TritonBackend
from disagg.gateway.call import Call
from disagg.gateway.choice_stream import ChoiceStream, collect
from disagg.gateway.errors import APIError
from disagg.gateway.http import StreamCounted, answers_errors, loggable, read_json, request_id
from disagg.gateway.metrics import GatewayMetrics
from disagg.gateway.registry import PublicModel, Registry

log = logging.getLogger("disagg.gateway")
VERSION_HEADER = "x-disagg-model-version"
ROUTE_TARGET_HEADER = "x-disagg-route-target"


class OpenAIRoutes:
    def __init__(
        self,
        keys: KeyStore | None,
        limiter: RateLimiter,
        registry: Registry,
        backend: TritonBackend,
        metrics: GatewayMetrics,
        max_body_bytes: int,
        max_n: int = oa.MAX_N,
    ) -> None:
        self.keys = keys  # None: authentication disabled (loopback only)
        self.limiter = limiter
        self.registry = registry
        self.backend = backend
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.max_n = max_n

    # -------------------------------------------------------------- auth

    def authenticate(self, request: Request) -> str:
        if self.keys is None:
            return "anonymous"
        key = self.keys.key_id(request.headers.get("authorization"))
        if key is None:
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        return key

    def admit(self, key: str) -> None:
        wait = self.limiter.admit(key)
        if wait is not None:
            raise APIError(
                429,
                f"Rate limit reached for this key; retry in {math.ceil(wait)} s",
                type_="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )

    # -------------------------------------------------------------- models

    @answers_errors
    async def models(self, request: Request) -> Response:
        self.authenticate(request)
        return JSONResponse(
            {"object": "list", "data": [self._model(m) for m in self.registry.listed()]}
        )

    @answers_errors
    async def model(self, request: Request) -> Response:
        self.authenticate(request)
        model, _ = self.registry.resolve(request.path_params["model"])
        return JSONResponse(self._model(model))

    @staticmethod
    def _model(m: PublicModel) -> dict[str, str | int]:
        return {"id": m.name, "object": "model", "created": 0, "owned_by": "disagg"}

    # -------------------------------------------------------------- generation

    async def chat(self, request: Request) -> Response:
        return await self._generate(Call(request, "chat", request_id(request)))

    async def completions(self, request: Request) -> Response:
        return await self._generate(Call(request, "completion", request_id(request)))

    async def _generate(self, call: Call) -> Response:
        """Serve one request and count it: here when answered whole, when its stream ends
        otherwise (a stream never started is counted by StreamCounted)."""
        m = self.metrics
        await self.backend.held_back()  # a planned restart of Triton: before it, not in flight
        m.inflight.inc()
        try:
            response = await self._serve(call)
        except Exception:  # a bug of ours: a clear 500, counted, and the gauge kept true
            log.exception("request failed")
            m.error("server_error")
            response = APIError(500, "internal error", "server_error").response()
        except BaseException:  # cancelled: the client went away
            m.inflight.dec()
            m.finished(call.api, call.model, 499, time.perf_counter() - call.start)
            raise
        if not isinstance(response, StreamCounted):
            m.inflight.dec()
            m.finished(call.api, call.model, response.status_code, time.perf_counter() - call.start)
        return response

    async def _serve(self, call: Call) -> Response:
        call.headers = {REQUEST_ID_HEADER: call.rid}
        try:
            call.key = self.authenticate(call.request)
            self.admit(call.key)
            body = await read_json(call.request, self.max_body_bytes)
            fmt = self.registry.tool_format(body.get("model") if isinstance(body, dict) else None)
            req = call.req = oa.parse_request(body, call.api, self.max_n, fmt)
            model, version = self.registry.resolve(req.model)
            call.model = model.name
            req.inputs[C.MODEL] = model.name  # routing rules may match on it
            oa.key_salt(call.key, req.inputs)
            call.headers[VERSION_HEADER] = version.name
            pieces = call.pieces = self.backend.generate(
                version.triton_model, version.triton_version, call.rid, req.inputs
            )
            log.info(
                "request %s key=%s model=%s version=%s stream=%s",
                call.rid, call.key, model.name, version.name, req.stream,
            )  # fmt: skip
            call.fingerprint = f"disagg-{model.name}-{version.name}"
            if req.n > 1:
                first = await pieces.__anext__()  # choice 0's prompt is cached from here
                streams = choices.open_choices(
                    call,
                    first,
                    lambda rid, inputs: self.backend.generate(
                        version.triton_model, version.triton_version, rid, inputs
                    ),
                )
                return await self._serve_choices(call, streams)
            if req.stream:
                first = await pieces.__anext__()  # errors before any output: HTTP errors
                response = self._stream(call, self._events(call, first), pieces.aclose)
                response.headers.update(call.headers)
                return response
            return await self._complete(call)
        except APIError as e:
            # the message may repeat the client's bad value: bounded, on one line
            log.info("request %s: %d %s", call.rid, e.status, loggable(e.message))
            self.metrics.error(e.code or e.type)
            return e.response(call.headers)
        except StopAsyncIteration:
            self.metrics.error("server_error")
            return APIError(502, "the model ended without a response", "server_error").response(
                call.headers
            )

    async def _complete(self, call: Call) -> Response:
        """Collect the whole reply, cancelling it if the client goes away meanwhile."""
        pieces, req = call.pieces, call.req
        assert pieces is not None and req is not None, "set by _serve"

        task = asyncio.ensure_future(collect(pieces))
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if not done and await call.request.is_disconnected():
                    log.info("request %s: client disconnected; cancelling", call.rid)
                    return Response(status_code=499)
        finally:
            if not task.done():  # stop reading before closing: aclose() on a generator that
                task.cancel()  # another task is still inside raises RuntimeError
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await pieces.aclose()  # cancels the request in Triton
        whole = task.result()
        last = whole.last
        if last is None or last.finish_reason is None:
            raise APIError(502, "the model ended without a finish reason", "server_error")
        self.limiter.charge(call.key, last.num_input_tokens + last.num_output_tokens)
        if last.finish_reason == C.FINISH_ERROR:
            raise _model_failed(last)
        headers = {**call.headers, ROUTE_TARGET_HEADER: last.extra.get(C.ROUTE_TARGET, "")}
        use = oa.usage(last.num_input_tokens, last.num_output_tokens, last.num_cached_tokens)
        body = oa.whole_body(req, call.rid, call.fingerprint, [whole.choice(req)], use)
        return JSONResponse(body, headers=headers)

    async def _serve_choices(self, call: Call, streams: list[choices.Pieces]) -> Response:
        """n > 1: every choice whole, or their chunks interleaved (gateway/choices.py)."""
        req = call.req
        assert req is not None, "set by _serve"
        if req.stream:

            async def close() -> None:
                await choices.close_all(streams)

            response = self._stream(call, choices.stream_events(call, streams), close)
            response.headers.update(call.headers)
            return response
        results = await choices.collect_all(call, streams)
        if results is None:
            return Response(status_code=499)
        lasts = [w.last for w in results if w.last is not None]  # (all: collect_all checks)
        charged = lasts[0].num_input_tokens + sum(p.num_output_tokens for p in lasts)
        self.limiter.charge(call.key, charged)
        for last in lasts:
            if last.finish_reason == C.FINISH_ERROR:
                raise _model_failed(last)
        return JSONResponse(choices.whole_response(call, results), headers=call.headers)

    def _stream(
        self, call: Call, events: AsyncIterator[bytes], close: Callable[[], Awaitable[None]]
    ) -> StreamCounted:
        """The SSE body and the bookkeeping that must run once when it ends, however it ends:
        finished, failed, the client gone mid-stream, or gone before the first byte."""
        ended = False

        async def end() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            self.limiter.charge(call.key, call.n_in + call.n_out)
            self.metrics.inflight.dec()
            self.metrics.finished(
                call.api, call.model, call.status, time.perf_counter() - call.start
            )
            await close()  # last: a client that went away cancels its request

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in events:
                    yield chunk
            finally:
                await end()

        return StreamCounted(body(), end, media_type="text/event-stream")

    async def _events(self, call: Call, first: Piece) -> AsyncIterator[bytes]:
        req, rid, fp, pieces = call.req, call.rid, call.fingerprint, call.pieces
        assert req is not None and pieces is not None, "set by _serve"
        first_text = True
        choice = ChoiceStream(req, rid, fp)
        try:
            if req.kind == "chat":
                yield oa.sse(oa.chunk(req, rid, fp, role=True))
            piece: Piece | None = first
            while piece is not None:
                call.n_in, call.n_out = piece.num_input_tokens, piece.num_output_tokens
                if piece.finish_reason == C.FINISH_ERROR:
                    err = _model_failed(piece)
                    call.status = err.status
                    self.metrics.error(err.type)
                    yield oa.sse(err.body())
                    return
                for c in choice.chunks(piece):
                    yield oa.sse(c)
                if piece.text and first_text:
                    ttft = time.perf_counter() - call.start
                    self.metrics.ttft.labels(call.model).observe(ttft)
                    first_text = False
                if piece.finish_reason is not None:
                    if req.include_usage:
                        usage = oa.usage_chunk(
                            req, rid, fp, call.n_in, call.n_out, piece.num_cached_tokens
                        )
                        yield oa.sse(usage)
                    break
                piece = await anext(pieces, None)
            call.status = 200
            yield oa.sse("[DONE]")
        except APIError as e:
            call.status = e.status
            self.metrics.error(e.code or e.type)
            yield oa.sse(e.body())


def _model_failed(piece: Piece) -> APIError:
    """A stage failed after part of the answer was produced (finish reason "error")."""
    return APIError(502, piece.extra.get(C.ERROR) or "the model failed", "server_error")
