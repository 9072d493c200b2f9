"""KV payloads over the network, prefill server to decode server, never through the frontend.

A prefill server that serves remote decode servers keeps each payload it computed under a
lease (`KVLeases`) and answers with a small reference instead of the bytes:

    b"DKVREF1" + JSON {"addr": "host:port", "handle": 32 hex digits, "nbytes": n}

The orchestrator forwards the reference like any payload; the decode server that gets it
pulls the bytes straight from the prefill server's `KVServer` (plain TCP, one connection per
pull) and verifies them as any payload (magic, layout, model fingerprint, CRC32: a failed or
partial transfer never reaches the cache). A lease ends when its payload is pulled or after
`ttl_s`. DROP (`drop`, `release`) frees one at once: an orchestrator drops the lease of a
request whose client left before decode pulled it (pipeline/handoff.py `release`).

Wire protocol (little endian), request: b"KVP1" | verb (b"PULL" or b"DROP") | 16-byte handle |
32-byte sha256 of the internal token. Response: status byte (0 ok, 1 unknown handle, 2 refused)
| u64 length | that many bytes. Large sends and `recv_into` a preallocated buffer keep Python
out of the per-byte path: loopback moves GB/s (benchmarks/kv_transfer_bench.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from disagg.errors import KVPayloadError

log = logging.getLogger("disagg.kvnet")
REF_MAGIC = b"DKVREF1"
PROTO = b"KVP1"
OK, UNKNOWN, REFUSED = 0, 1, 2
_REQUEST = struct.Struct("<4s4s16s32s")
_REPLY = struct.Struct("<BQ")
CHUNK = 4 << 20  # bytes per send/recv call
# A pull runs on decode's request path, so a lost path must cost seconds, not the whole
# `timeout_s` (a deadline for the whole pull): a KV server that does not take a connection in
# CONNECT_TIMEOUT_S (Linux resends a SYN after 1 s and 3 s: both may be answered), or a
# transfer that receives nothing for STALL_TIMEOUT_S, has lost its path (a partition); decode
# then prefills the prompt itself. After a connect fails, pulls from that address fail at
# once for UNREACHABLE_HOLD_S, then it is tried again (a healed partition needs no restart).
CONNECT_TIMEOUT_S = 4.0
STALL_TIMEOUT_S = 5.0
UNREACHABLE_HOLD_S = 5.0


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class KVRef:
    """Where a leased payload is and how big it is."""

    addr: str  # host:port of the prefill server's KVServer
    handle: str  # 32 hex digits
    nbytes: int

    def to_bytes(self) -> bytes:
        body = {"addr": self.addr, "handle": self.handle, "nbytes": self.nbytes}
        return REF_MAGIC + json.dumps(body).encode()

    @classmethod
    def parse(cls, data: bytes | memoryview) -> KVRef | None:
        """The reference in `data`, or None when `data` is a payload itself."""
        head = bytes(data[: len(REF_MAGIC)])
        if head != REF_MAGIC:
            return None
        try:
            body = json.loads(bytes(data[len(REF_MAGIC) :]))
            ref = cls(str(body["addr"]), str(body["handle"]), int(body["nbytes"]))
            bytes.fromhex(ref.handle)
        except (ValueError, KeyError, TypeError) as e:
            raise KVPayloadError(f"KV reference unreadable: {e}") from e
        if len(ref.handle) != 32 or ref.nbytes < 0:
            raise KVPayloadError("KV reference malformed")
        return ref


class KVLeases:
    """Payloads held for pulling: bounded in bytes, each freed on pull, drop or expiry."""

    def __init__(
        self,
        capacity_bytes: int = 2 << 30,
        ttl_s: float = 30.0,
        on_change: Callable[[int], None] | None = None,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.on_change = on_change  # called with the bytes held after each change (a gauge)
        self._held: dict[str, tuple[NDArray[Any], float]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.expired = 0  # leases that ran out (a decode that died, a client that left)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._held)

    def put(self, payload: NDArray[Any] | bytes | memoryview) -> str:
        """Copy `payload` (the caller reuses its buffer) and return its handle."""
        data = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload
        self.expire()
        with self._lock:
            if self._bytes + data.nbytes > self.capacity_bytes:
                raise KVPayloadError(
                    f"KV lease capacity full ({self._bytes >> 20} MiB held of "
                    f"{self.capacity_bytes >> 20} MiB): decode servers are not pulling"
                )
            handle = secrets.token_hex(16)
            self._held[handle] = (data.copy(), time.monotonic() + self.ttl_s)
            self._bytes += data.nbytes
        self._changed()
        return handle

    def take(self, handle: str) -> NDArray[Any] | None:
        with self._lock:
            entry = self._held.pop(handle, None)
            if entry is not None:
                self._bytes -= entry[0].nbytes
        if entry is not None:
            self._changed()
        return None if entry is None else entry[0]

    def drop(self, handle: str) -> bool:
        return self.take(handle) is not None

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [h for h, (_, deadline) in self._held.items() if deadline <= now]
            for h in old:
                self._bytes -= self._held.pop(h)[0].nbytes
            self.expired += len(old)
        if old:
            log.warning("freed %d KV leases nobody pulled within %.0f s", len(old), self.ttl_s)
            self._changed()
        return len(old)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self._bytes)


class KVServer:
    """Serves `leases` on a TCP port: PULL (take and send) and DROP, token checked."""

    def __init__(self, leases: KVLeases, token: str, host: str = "127.0.0.1", port: int = 0):
        self.leases = leases
        self._digest = token_digest(token)
        self._sock = socket.create_server((host, port), backlog=64)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._stop = threading.Event()
        self.pulled_bytes = 0
        self._thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)

    def start(self) -> KVServer:
        self._thread.start()
        threading.Thread(target=self._reap, name="kv-leases", daemon=True).start()
        return self

    def address(self, advertise_host: str | None = None) -> str:
        return f"{advertise_host or self.host}:{self.port}"

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()

    def _reap(self) -> None:
        while not self._stop.wait(min(5.0, self.leases.ttl_s / 2)):
            self.leases.expire()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                raw = _recv_exact(conn, _REQUEST.size)
                proto, verb, handle, digest = _REQUEST.unpack(raw)
                if proto != PROTO or not hmac.compare_digest(digest, self._digest):
                    conn.sendall(_REPLY.pack(REFUSED, 0))
                    return
                if verb == b"DROP":
                    found = self.leases.drop(handle.hex())
                    conn.sendall(_REPLY.pack(OK if found else UNKNOWN, 0))
                    return
                data = self.leases.take(handle.hex()) if verb == b"PULL" else None
                if data is None:
                    conn.sendall(_REPLY.pack(UNKNOWN, 0))
                    return
                conn.sendall(_REPLY.pack(OK, data.nbytes))
                view = data.data  # memoryview(data), which numpy 1.26's stubs do not type
                for i in range(0, data.nbytes, CHUNK):
                    conn.sendall(view[i : i + CHUNK])
                self.pulled_bytes += data.nbytes
            except (OSError, KVPayloadError) as e:
                log.info("KV connection ended early: %s", e)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview, deadline: float = float("inf")) -> None:
    got = 0
    while got < len(view):
        if time.monotonic() > deadline:
            raise KVPayloadError(f"KV transfer too slow: {got} of {len(view)} bytes in time")
        n = conn.recv_into(view[got : got + CHUNK])
        if n == 0:
            raise KVPayloadError(f"KV transfer cut off after {got} of {len(view)} bytes")
        got += n


class Unreachable:
    """KV server addresses a connect to failed lately: a pull from one fails at once until
    `hold_s` after that failure, instead of each request waiting out its own connect."""

    def __init__(self, hold_s: float = UNREACHABLE_HOLD_S) -> None:
        self.hold_s = hold_s
        self._since: dict[str, tuple[float, str]] = {}  # addr -> (monotonic time, why)
        self._lock = threading.Lock()

    def check(self, addr: str) -> None:
        with self._lock:
            failed = self._since.get(addr)
            if failed is None:
                return
            age = time.monotonic() - failed[0]
            if age >= self.hold_s:
                del self._since[addr]  # try it again
                return
        raise KVPayloadError(f"KV server {addr} unreachable ({failed[1]}, {age:.1f} s ago)")

    def failed(self, addr: str, why: str) -> None:
        with self._lock:
            self._since[addr] = (time.monotonic(), why)

    def reached(self, addr: str) -> None:
        with self._lock:
            self._since.pop(addr, None)


UNREACHABLE = Unreachable()


def _request(ref: KVRef, verb: bytes, token: str, timeout_s: float) -> tuple[socket.socket, int]:
    host, _, port = ref.addr.rpartition(":")
    UNREACHABLE.check(ref.addr)
    try:
        conn = socket.create_connection((host, int(port)), min(timeout_s, CONNECT_TIMEOUT_S))
    except ValueError as e:
        raise KVPayloadError(f"KV reference {ref.addr!r} unusable: {e}") from e
    except OSError as e:
        UNREACHABLE.failed(ref.addr, f"connect: {e}")
        raise KVPayloadError(f"KV server {ref.addr} unreachable: {e}") from e
    UNREACHABLE.reached(ref.addr)
    conn.settimeout(min(timeout_s, STALL_TIMEOUT_S))  # between bytes, not for the whole pull
    try:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(_REQUEST.pack(PROTO, verb, bytes.fromhex(ref.handle), token_digest(token)))
        status, length = _REPLY.unpack(_recv_exact(conn, _REPLY.size))
    except (OSError, KVPayloadError) as e:
        conn.close()
        raise KVPayloadError(f"KV server {ref.addr}: {e}") from e
    if status == REFUSED:
        conn.close()
        raise KVPayloadError(f"KV server {ref.addr} refused the internal token")
    if status == UNKNOWN:
        conn.close()
        raise KVPayloadError(
            f"KV payload {ref.handle[:8]} is not held at {ref.addr} (pulled, dropped or expired)"
        )
    return conn, length


def pull(
    ref: KVRef, token: str, timeout_s: float = 30.0, out: NDArray[np.uint8] | None = None
) -> NDArray[np.uint8]:
    """The payload's bytes (a uint8 array, in `out` when it is large enough)."""
    deadline = time.monotonic() + timeout_s
    conn, length = _request(ref, b"PULL", token, timeout_s)
    with conn:
        if length != ref.nbytes:
            raise KVPayloadError(f"KV server sent {length} bytes, the reference says {ref.nbytes}")
        fits = out is not None and out.nbytes >= length
        buf = out[:length] if out is not None and fits else np.empty(length, np.uint8)
        try:
            _recv_into(conn, buf.data, deadline)  # memoryview(buf), as typed (see _handle)
        except OSError as e:
            raise KVPayloadError(f"KV transfer from {ref.addr} failed: {e}") from e
    return buf


def drop(ref: KVRef, token: str, timeout_s: float = 5.0) -> bool:
    """Free a lease nobody will pull (best effort: the TTL frees it otherwise)."""
    try:
        conn, _ = _request(ref, b"DROP", token, timeout_s)
    except KVPayloadError as e:
        log.info("KV lease %s not dropped: %s", ref.handle[:8], e)
        return False
    conn.close()
    return True


def release(payload: NDArray[np.uint8] | bytes | memoryview, token: str) -> bool:
    """Drop the lease `payload` names, when it is a reference (a payload itself is freed by
    letting go of it): whether a lease was dropped."""
    array = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)
    data = np.ascontiguousarray(array, np.uint8).reshape(-1).data
    ref = KVRef.parse(data)
    return ref is not None and drop(ref, token)


def advertise_host(bind_host: str) -> str:
    """The address decode servers reach this one at when the advertise_host setting is not
    given: the bind host, unless it is a wildcard (then this host's name)."""
    if bind_host in ("0.0.0.0", "::"):
        return socket.gethostname()
    return bind_host
