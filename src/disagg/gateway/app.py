"""The gateway's HTTP app (Starlette): OpenAI routes, auth, limits, admin, request ids."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from disagg import contracts as C
from disagg.contracts import ADMIN_HEADER, REQUEST_ID_HEADER, client_request_id
from disagg.gateway import openai_api as oa
from disagg.gateway.auth import KeyStore, RateLimiter
from disagg.gateway.backend import Piece, TritonBackend
from disagg.gateway.errors import APIError, bad_request
from disagg.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from disagg.gateway.registry import Registry

log = logging.getLogger("disagg.gateway")
VERSION_HEADER = "x-disagg-model-version"


@dataclass
class GatewayConfig:
    keys: KeyStore | None  # None: authentication disabled (loopback only)
    limiter: RateLimiter
    registry: Registry
    backend: TritonBackend
    admin_key: str | None
    max_body_bytes: int = 1 << 20


def request_id(request: Request) -> str:
    return client_request_id(request.headers.get(REQUEST_ID_HEADER, "")) or uuid.uuid4().hex


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

    def __init__(self, content, on_end, **kw) -> None:
        super().__init__(content, **kw)
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_end()


class Gateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.metrics = GatewayMetrics()
        cfg.backend.on_retry = self.metrics.retries.inc

    # -------------------------------------------------------------- auth

    def authenticate(self, request: Request) -> str:
        if self.cfg.keys is None:
            return "anonymous"
        key = self.cfg.keys.key_id(request.headers.get("authorization"))
        if key is None:
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        return key

    def admit(self, key: str) -> None:
        wait = self.cfg.limiter.admit(key)
        if wait is not None:
            raise APIError(
                429,
                f"Rate limit reached for this key; retry in {math.ceil(wait)} s",
                type_="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )

    # -------------------------------------------------------------- routes

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        models = {v.triton_model for m in self.cfg.registry.listed() for v in m.versions}
        states = {m: await self.cfg.backend.is_ready(m) for m in sorted(models)}
        # the entry models can be READY while a model behind them (decode) is reloading
        server = await self.cfg.backend.is_server_ready()
        ready = server and all(states.values())
        return JSONResponse(
            {"ready": ready, "triton_server": server, "triton_models": states},
            status_code=200 if ready else 503,
        )

    async def models(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            self.authenticate(request)
            return JSONResponse(
                {"object": "list", "data": [self._model(m) for m in self.cfg.registry.listed()]}
            )
        except APIError as e:
            return e.response({REQUEST_ID_HEADER: rid})

    async def model(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            self.authenticate(request)
            name = request.path_params["model"]
            model, _ = self.cfg.registry.resolve(name)
            return JSONResponse(self._model(model))
        except APIError as e:
            return e.response({REQUEST_ID_HEADER: rid})

    @staticmethod
    def _model(m) -> dict:
        return {"id": m.name, "object": "model", "created": 0, "owned_by": "disagg"}

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def _generate(self, request: Request, kind: str) -> Response:
        """Serve one request and count it: here when answered whole, when its stream ends
        otherwise (a stream never started is counted by StreamCounted)."""
        m, start = self.metrics, time.perf_counter()
        labels = {"api": kind, "model": "unknown"}
        m.inflight.inc()
        try:
            response = await self._serve(request, kind, labels, start)
        except Exception:  # a bug of ours: a clear 500, counted, and the gauge kept true
            log.exception("request failed")
            self.metrics.error("server_error")
            response = APIError(500, "internal error", "server_error").response()
        except BaseException:  # cancelled: the client went away
            m.inflight.dec()
            m.finished(labels["api"], labels["model"], 499, time.perf_counter() - start)
            raise
        if not isinstance(response, StreamCounted):
            m.inflight.dec()
            m.finished(
                labels["api"], labels["model"], response.status_code, time.perf_counter() - start
            )
        return response

    async def _serve(self, request: Request, kind: str, labels: dict, start: float) -> Response:
        rid = request_id(request)
        headers = {REQUEST_ID_HEADER: rid}
        try:
            key = self.authenticate(request)
            self.admit(key)
            req = oa.parse_request(await read_json(request, self.cfg.max_body_bytes), kind)
            model, version = self.cfg.registry.resolve(req.model)
            labels["model"] = model.name
            req.inputs["model"] = model.name  # routing rules may match on it
            headers[VERSION_HEADER] = version.name
            pieces = self.cfg.backend.generate(
                version.triton_model, version.triton_version, rid, req.inputs
            )
            log.info(
                "request %s key=%s model=%s version=%s stream=%s",
                rid, key, model.name, version.name, req.stream,
            )  # fmt: skip
            fingerprint = f"disagg-{model.name}-{version.name}"
            if req.stream:
                first = await pieces.__anext__()  # errors before any output are HTTP errors
                response = self._stream(req, rid, fingerprint, first, pieces, key, labels, start)
                response.headers.update(headers)
                return response
            return await self._complete(request, req, rid, fingerprint, pieces, key, headers)
        except APIError as e:
            log.info("request %s: %d %s", rid, e.status, e.message)
            self.metrics.error(e.code or e.type)
            return e.response(headers)
        except StopAsyncIteration:
            self.metrics.error("server_error")
            return APIError(502, "the model ended without a response", "server_error").response(
                headers
            )

    async def _complete(self, request, req, rid, fingerprint, pieces, key, headers) -> Response:
        """Collect the whole reply, cancelling it if the client goes away meanwhile."""

        async def collect() -> tuple[str, Piece]:
            text, last = "", None
            async for piece in pieces:
                text += piece.text
                last = piece
            return text, last

        task = asyncio.ensure_future(collect())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if not done and await request.is_disconnected():
                    log.info("request %s: client disconnected; cancelling", rid)
                    return Response(status_code=499)
        finally:
            if not task.done():  # stop reading before closing: aclose() on a generator that
                task.cancel()  # another task is still inside raises RuntimeError
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await pieces.aclose()  # cancels the request in Triton
        text, last = task.result()
        if last is None or last.finish_reason is None:
            raise APIError(502, "the model ended without a finish reason", "server_error")
        self.cfg.limiter.charge(key, last.num_input_tokens + last.num_output_tokens)
        if last.finish_reason == C.FINISH_ERROR:
            raise APIError(502, last.extra.get(C.ERROR) or "the model failed", "server_error")
        headers = {**headers, "x-disagg-route-target": last.extra.get(C.ROUTE_TARGET, "")}
        body = oa.full_response(
            req,
            rid,
            text,
            last.finish_reason,
            last.num_input_tokens,
            last.num_output_tokens,
            fingerprint,
        )
        return JSONResponse(body, headers=headers)

    def _stream(self, req, rid, fingerprint, first: Piece, pieces, key, labels, start):
        """The SSE body and the bookkeeping that must run once when it ends, however it ends:
        finished, failed, the client gone mid-stream, or gone before the first byte."""
        ended = False
        sent = {"n_in": 0, "n_out": 0, "status": 499}  # what a client that left had received

        async def end() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            self.cfg.limiter.charge(key, sent["n_in"] + sent["n_out"])
            self.metrics.inflight.dec()
            self.metrics.finished(
                labels["api"], labels["model"], sent["status"], time.perf_counter() - start
            )
            await pieces.aclose()  # last: a client that went away cancels its request in Triton

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in self._events(req, rid, fingerprint, first, pieces, labels,
                                                start, sent):  # fmt: skip
                    yield chunk
            finally:
                await end()

        return StreamCounted(body(), end, media_type="text/event-stream")

    async def _events(self, req, rid, fingerprint, first, pieces, labels, start, sent):
        first_text = True
        try:
            if req.kind == "chat":
                yield oa.sse(oa.chunk(req, rid, fingerprint, role=True))
            piece: Piece | None = first
            while piece is not None:
                sent["n_in"], sent["n_out"] = piece.num_input_tokens, piece.num_output_tokens
                if piece.finish_reason == C.FINISH_ERROR:
                    err = APIError(
                        502, piece.extra.get(C.ERROR) or "the model failed", "server_error"
                    )
                    sent["status"] = err.status
                    self.metrics.error(err.type)
                    yield oa.sse(err.body())
                    return
                if piece.text:
                    yield oa.sse(oa.chunk(req, rid, fingerprint, text=piece.text))
                    if first_text:
                        self.metrics.ttft.labels(labels["model"]).observe(
                            time.perf_counter() - start
                        )
                        first_text = False
                if piece.finish_reason is not None:
                    yield oa.sse(oa.chunk(req, rid, fingerprint, finish=piece.finish_reason))
                    if req.include_usage:
                        yield oa.sse(
                            oa.usage_chunk(req, rid, fingerprint, sent["n_in"], sent["n_out"])
                        )
                    break
                piece = await anext(pieces, None)
            sent["status"] = 200
            yield oa.sse("[DONE]")
        except APIError as e:
            sent["status"] = e.status
            self.metrics.error(e.code or e.type)
            yield oa.sse(e.body())

    # -------------------------------------------------------------- admin

    def check_admin(self, request: Request) -> None:
        if not self.cfg.admin_key:
            raise APIError(403, "admin API disabled: start with DISAGG_ADMIN_KEY set")
        given = request.headers.get(ADMIN_HEADER, "")
        if not hmac.compare_digest(given.encode(), self.cfg.admin_key.encode()):
            raise APIError(401, f"admin API: wrong or missing '{ADMIN_HEADER}' header")

    async def admin_models(self, request: Request) -> Response:
        try:
            self.check_admin(request)
            return JSONResponse(self.cfg.registry.state())
        except APIError as e:
            return e.response()

    async def admin_version(self, request: Request) -> Response:
        try:
            self.check_admin(request)
            body = await read_json(request, 4096)
            if not isinstance(body, dict) or set(body) - {"state", "weight"}:
                raise bad_request('body: {"state": ..., "weight": ...}')
            p = request.path_params
            v = self.cfg.registry.update(
                p["model"], p["version"], body.get("state"), body.get("weight")
            )
            log.info("admin: %s version %s -> %s", p["model"], v.name, v)
            return JSONResponse(v.__dict__)
        except APIError as e:
            return e.response()

    async def admin_rollback(self, request: Request) -> Response:
        try:
            self.check_admin(request)
            rolled = self.cfg.registry.rollback(request.path_params["model"])
            log.info("admin: rolled back %s: %s", request.path_params["model"], rolled)
            return JSONResponse({"rolled_back": rolled})
        except APIError as e:
            return e.response()


def create_app(cfg: GatewayConfig) -> Starlette:
    g = Gateway(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await cfg.backend.close()

    return Starlette(
        routes=[
            Route("/health", g.health),
            Route("/metrics", g.metrics_page),
            Route("/ready", g.ready),
            Route("/v1/models", g.models),
            Route("/v1/models/{model:path}", g.model),
            Route("/v1/chat/completions", g.chat, methods=["POST"]),
            Route("/v1/completions", g.completions, methods=["POST"]),
            Route("/admin/models", g.admin_models),
            Route("/admin/models/{model}/versions/{version}", g.admin_version, methods=["POST"]),
            Route("/admin/models/{model}/rollback", g.admin_rollback, methods=["POST"]),
        ],
        lifespan=lifespan,
    )
