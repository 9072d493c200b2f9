"""The gateway's HTTP app (Starlette): which routes exist and who serves them.

    /health, /ready, /metrics            here
    /v1/models, /v1/chat/completions,
    /v1/completions                      openai_routes.py (keys, limits, registry, SSE)
    /admin/...                           admin.py (admin key)

Request plumbing (ids, safe body reading, error responses) is in http.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from disagg.gateway.admin import AdminRoutes
from disagg.gateway.auth import KeyStore, RateLimiter
from disagg.gateway.backend import TritonBackend
from disagg.gateway.http import HeadLimit
from disagg.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from disagg.gateway.openai_routes import OpenAIRoutes
from disagg.gateway.registry import Registry


@dataclass
class GatewayConfig:
    keys: KeyStore | None  # None: authentication disabled (loopback only)
    limiter: RateLimiter
    registry: Registry
    backend: TritonBackend
    admin_key: str | None
    max_body_bytes: int = 1 << 20
    # choices one request may ask for: at most the sequences decode runs at once (more could
    # not decode together; openai_api.MAX_N caps it)
    max_n: int = 16


class Probes:
    """Liveness, readiness (every listed version's Triton model, and Triton itself) and the
    gateway's own metrics."""

    def __init__(self, registry: Registry, backend: TritonBackend, metrics: GatewayMetrics):
        self.registry = registry
        self.backend = backend
        self.metrics = metrics

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        models = {v.triton_model for m in self.registry.listed() for v in m.versions}
        states = {m: await self.backend.is_ready(m) for m in sorted(models)}
        # the entry models can be READY while a model behind them (decode) is reloading
        server = await self.backend.is_server_ready()
        ready = server and all(states.values())
        return JSONResponse(
            {"ready": ready, "triton_server": server, "triton_models": states},
            status_code=200 if ready else 503,
        )

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def create_app(cfg: GatewayConfig) -> Starlette:
    metrics = GatewayMetrics()
    cfg.backend.on_retry = metrics.retries.inc
    cfg.backend.on_hold = metrics.held.inc
    probes = Probes(cfg.registry, cfg.backend, metrics)
    api = OpenAIRoutes(
        cfg.keys, cfg.limiter, cfg.registry, cfg.backend, metrics, cfg.max_body_bytes, cfg.max_n
    )
    admin = AdminRoutes(cfg.registry, cfg.admin_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await cfg.backend.close()

    return Starlette(
        routes=[
            Route("/health", probes.health),
            Route("/metrics", probes.metrics_page),
            Route("/ready", probes.ready),
            Route("/v1/models", api.models),
            Route("/v1/models/{model:path}", api.model),
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/admin/models", admin.models),
            Route("/admin/models/{model}/versions/{version}", admin.version, methods=["POST"]),
            Route("/admin/models/{model}/rollback", admin.rollback, methods=["POST"]),
        ],
        lifespan=lifespan,
        middleware=[Middleware(HeadLimit)],  # 431 before any route reads a huge head
    )
