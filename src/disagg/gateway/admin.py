"""The gateway's admin routes: model versions, canary weights and rollback (docs/gateway.md).
They need the admin key (contracts.ADMIN_HEADER) and are off when none was given."""

from __future__ import annotations

import hmac
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from disagg.contracts import ADMIN_HEADER, ADMIN_KEY_ENV
from disagg.gateway.errors import APIError, bad_request
from disagg.gateway.http import answers_errors, read_json
from disagg.gateway.registry import Registry

log = logging.getLogger("disagg.gateway")


class AdminRoutes:
    def __init__(self, registry: Registry, admin_key: str | None) -> None:
        self.registry = registry
        self.admin_key = admin_key

    def check(self, request: Request) -> None:
        if not self.admin_key:
            raise APIError(403, f"admin API disabled: start with {ADMIN_KEY_ENV} set")
        given = request.headers.get(ADMIN_HEADER, "")
        if not hmac.compare_digest(given.encode(), self.admin_key.encode()):
            raise APIError(401, f"admin API: wrong or missing '{ADMIN_HEADER}' header")

    @answers_errors
    async def models(self, request: Request) -> Response:
        self.check(request)
        return JSONResponse(self.registry.state())

    @answers_errors
    async def version(self, request: Request) -> Response:
        self.check(request)
        body = await read_json(request, 4096)
        if not isinstance(body, dict) or set(body) - {"state", "weight"}:
            raise bad_request('body: {"state": ..., "weight": ...}')
        p = request.path_params
        v = self.registry.update(p["model"], p["version"], body.get("state"), body.get("weight"))
        log.info("admin: %s version %s -> %s", p["model"], v.name, v)
        return JSONResponse(v.__dict__)

    @answers_errors
    async def rollback(self, request: Request) -> Response:
        self.check(request)
        rolled = self.registry.rollback(request.path_params["model"])
        log.info("admin: rolled back %s: %s", request.path_params["model"], rolled)
        return JSONResponse({"rolled_back": rolled})
