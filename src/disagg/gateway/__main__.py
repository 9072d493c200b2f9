"""`disagg gateway`: the OpenAI-compatible gateway in front of a running Triton.

Settings come from the same place as `disagg serve` (defaults, --config TOML, DISAGG_*
variables): Triton's gRPC port, the gateway's port, keys, limits and model registry. API keys
come from DISAGG_API_KEYS and/or the keys file; the admin API needs DISAGG_ADMIN_KEY.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import uvicorn

from disagg.contracts import ADMIN_KEY_ENV
from disagg.errors import ConfigError
from disagg.gateway.app import GatewayConfig, create_app
from disagg.gateway.auth import KEYS_ENV, KeyStore, RateLimiter
from disagg.gateway.backend import TritonBackend
from disagg.gateway.http import MAX_HEAD_BYTES, H11HeadLimit
from disagg.gateway.openai_api import MAX_N
from disagg.gateway.registry import Registry
from disagg.hold import Hold
from disagg.settings import ServeSettings


def _env_keys(env: Mapping[str, str]) -> str:
    """DISAGG_API_KEYS, and the keys in the file DISAGG_API_KEYS_FILE names (a compose or
    Kubernetes secret: keys separated by commas or new lines)."""
    keys = env.get(KEYS_ENV, "")
    path = env.get(KEYS_ENV + "_FILE")
    if path:
        try:
            keys += "," + ",".join(Path(path).read_text().split())
        except OSError as e:
            raise ConfigError(f"{KEYS_ENV}_FILE: {e}") from e
    return keys


def build_config(settings: ServeSettings, env: Mapping[str, str] = os.environ) -> GatewayConfig:
    keys = None
    if settings.gateway_auth:
        keys = KeyStore.load(_env_keys(env), settings.keys_file)
        if not keys.hashes:
            raise ConfigError(
                f"no API keys: set {KEYS_ENV}, or put sha256:<hex> lines in {settings.keys_file} "
                "(make serve creates one key when there are none)"
            )
    backend = TritonBackend(
        settings.gateway_triton_url or f"{settings.host}:{settings.grpc_port}",
        settings.gateway_timeout_s,
    )
    backend.hold = Hold.in_dir(settings.path("build_dir"))  # serve's planned restarts
    return GatewayConfig(
        keys=keys,
        limiter=RateLimiter(settings.gateway_rpm, settings.gateway_tpm),
        registry=Registry(settings.path("gateway_models")),
        backend=backend,
        admin_key=env.get(ADMIN_KEY_ENV) or None,
        max_body_bytes=settings.gateway_max_body_bytes,
        max_n=min(MAX_N, settings.decode_max_num_seqs),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="disagg gateway", description=__doc__)
    p.add_argument("--config", help="TOML settings file (env DISAGG_<SETTING> overrides it)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        settings = ServeSettings.load(a.config)
        cfg = build_config(settings)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(
        create_app(cfg),
        host=settings.host,
        port=settings.gateway_port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        # h11 always (not httptools when installed): a head past MAX_HEAD_BYTES is a 431
        http=H11HeadLimit,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
