"""One generation request on its way through the gateway (openai_routes.py, choices.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from starlette.requests import Request

from disagg.gateway import openai_api as oa
from disagg.gateway.backend import Piece


@dataclass
class Call:
    """One generation request on its way through the gateway."""

    request: Request
    api: str  # "chat" | "completion"
    rid: str
    start: float = field(default_factory=time.perf_counter)
    model: str = "unknown"  # the public model name, once resolved (a metric label)
    key: str = ""
    req: oa.GenRequest | None = None
    fingerprint: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    pieces: AsyncGenerator[Piece, None] | None = None
    # what the client has received, for a stream that ends early (status 499: client gone)
    n_in: int = 0
    n_out: int = 0
    status: int = 499
