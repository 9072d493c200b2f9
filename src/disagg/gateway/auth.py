"""API keys (only their SHA-256 is kept) and per-key limits on requests and tokens per minute.

Keys come from DISAGG_API_KEYS (comma-separated) and/or a keys file of `sha256:<hex>` lines.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

from disagg.errors import ConfigError

KEYS_ENV = "DISAGG_API_KEYS"
WINDOW_S = 60.0


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "sk-disagg-" + secrets.token_urlsafe(24)


def write_keys_file(path: Path, hashes: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"sha256:{h}\n" for h in hashes))
    path.chmod(0o600)


class KeyStore:
    def __init__(self, hashes: set[str]) -> None:
        self.hashes = hashes

    @classmethod
    def load(cls, env_value: str | None, keys_file: Path | None) -> KeyStore:
        hashes = {key_hash(k.strip()) for k in (env_value or "").split(",") if k.strip()}
        if keys_file is not None and keys_file.is_file():
            for n, line in enumerate(keys_file.read_text().splitlines(), 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                if not line.startswith("sha256:") or len(line) != 7 + 64:
                    raise ConfigError(f"{keys_file}:{n}: expected 'sha256:<64 hex digits>'")
                hashes.add(line[7:].lower())
        return cls(hashes)

    def key_id(self, authorization: str | None) -> str | None:
        """The caller's key id (a hash prefix, safe to log) or None when the key is wrong."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = key_hash(authorization[7:].strip())
        for h in self.hashes:
            if hmac.compare_digest(h, digest):
                return h[:12]
        return None


_Window = collections.deque[tuple[float, int]]


class RateLimiter:
    """Sliding one-minute windows per key: requests when admitted, tokens when served."""

    def __init__(self, rpm: int, tpm: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rpm, self.tpm, self.clock = rpm, tpm, clock
        # key -> (monotonic time, requests or tokens) within the last WINDOW_S
        self.requests: dict[str, _Window] = collections.defaultdict(collections.deque)
        self.tokens: dict[str, _Window] = collections.defaultdict(collections.deque)
        self.lock = threading.Lock()

    def _trim(self, q: _Window, now: float) -> None:
        while q and q[0][0] <= now - WINDOW_S:
            q.popleft()

    def admit(self, key: str) -> float | None:
        """None if the request may run (and is counted), else seconds to wait."""
        now = self.clock()
        with self.lock:
            reqs, toks = self.requests[key], self.tokens[key]
            self._trim(reqs, now)
            self._trim(toks, now)
            if self.rpm and len(reqs) >= self.rpm:
                return reqs[0][0] + WINDOW_S - now
            if self.tpm and sum(n for _, n in toks) >= self.tpm:
                return toks[0][0] + WINDOW_S - now
            reqs.append((now, 1))
            return None

    def charge(self, key: str, tokens: int) -> None:
        with self.lock:
            self.tokens[key].append((self.clock(), tokens))
