"""KV cache events: a pool server's prefix cache, followed by the frontends that route to it.

Each prefill and decode instance of a pool server (role prefill or decode, `kv_events_port`
set) publishes what its prefix cache (engine/prefix_cache.py) does, as Dynamo's KV router
workers publish theirs: the blocks it stored and the blocks it evicted, in order. A frontend
keeps one TCP connection open to each instance it may route to (`Subscriber`), so it knows
which blocks each holds without asking anything per request (remote/cache_route.py scores
replicas by it). Several frontends subscribe, each on its own; there is no coordinator.

Wire protocol. The subscriber sends b"KVE1" + sha256(internal token) (36 bytes); a wrong
token closes the connection. The publisher then sends frames, each a u32 byte count (little
endian) and that many bytes of UTF-8 JSON, block hashes in hex:

    {"t": "hello", "epoch": "9f..", "pool": "decode", "instance": 0, "root": "ab..",
     "block_size": 16, "capacity_blocks": 1024}
    {"t": "snapshot", "seq": 41, "blocks": ["5c..", ...]}   every block held after event 41
    {"t": "stored", "seq": 42, "blocks": [...]}              event 42: blocks now held
    {"t": "removed", "seq": 43, "blocks": [...]}             event 43: blocks evicted
    {"t": "load", ...}                                       every heartbeat_s: its load

`epoch` is new each time the process starts: a restarted instance is a new, empty cache.
Events follow each other by seq; a subscriber that falls behind the bounded log gets a new
snapshot, one that sees a gap reconnects. A subscriber that hears nothing for `timeout_s`
(1 s: four heartbeats) or whose connection drops forgets the instance's blocks at once, so a
replica that dies or restarts is known within a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("disagg.kvevents")
PROTO = b"KVE1"
_FRAME = struct.Struct("<I")
MAX_FRAME = 64 << 20  # a snapshot of a million blocks is ~35 MB of hex
HELLO, SNAPSHOT, STORED, REMOVED, LOAD = "hello", "snapshot", "stored", "removed", "load"
Event = tuple[int, str, list[str]]  # (seq, kind, block hashes in hex)


class ProtocolError(Exception):
    """The other side sent something this protocol does not allow."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def send_frame(conn: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    conn.sendall(_FRAME.pack(len(body)) + body)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ProtocolError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_frame(conn: socket.socket) -> dict[str, Any]:
    (n,) = _FRAME.unpack(_recv_exact(conn, _FRAME.size))
    if n > MAX_FRAME:
        raise ProtocolError(f"a frame of {n} bytes")
    message = json.loads(_recv_exact(conn, n))
    if not isinstance(message, dict) or "t" not in message:
        raise ProtocolError("a frame that is not an event")
    return message


# ------------------------------------------------------------------ publisher (pool server)


class EventLog:
    """The last `max_events` events of one cache, numbered from 1; waiters wake on each."""

    def __init__(self, max_events: int = 4096) -> None:
        self._events: deque[Event] = deque(maxlen=max_events)
        self._seq = 0
        self._cond = threading.Condition()

    @property
    def seq(self) -> int:
        with self._cond:
            return self._seq

    def append(self, kind: str, hashes: list[bytes]) -> None:
        with self._cond:
            self._seq += 1
            self._events.append((self._seq, kind, [h.hex() for h in hashes]))
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake the waiters without an event (the load changed)."""
        with self._cond:
            self._cond.notify_all()

    def since(self, seq: int, timeout_s: float) -> list[Event] | None:
        """The events after `seq` (waiting up to timeout_s for one); None when some of them
        are no longer kept (the caller needs a snapshot)."""
        with self._cond:
            if self._seq == seq:
                self._cond.wait(timeout_s)
            if self._seq == seq:
                return []
            if not self._events or self._events[0][0] > seq + 1:
                return None
            return [e for e in self._events if e[0] > seq]


class Cache(Protocol):
    """What a publisher needs of a prefix cache (engine/kv_reuse.py KVReuse)."""

    @property
    def root(self) -> bytes: ...

    def publish(self, on_event: Callable[[str, list[bytes]], None]) -> None: ...

    def snapshot(self, seq: Callable[[], int]) -> tuple[int, list[bytes]]: ...


class Publisher:
    """One instance's prefix cache, served to subscribers on a TCP port."""

    def __init__(
        self,
        cache: Cache,
        token: str,
        *,
        pool: str,
        instance: int = 0,
        block_size: int = 16,
        capacity_blocks: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        load: Callable[[], dict[str, int]] | None = None,
        heartbeat_s: float = 0.25,
        max_events: int = 4096,
    ) -> None:
        self.cache = cache
        self.log = EventLog(max_events)
        self.hello = {
            "t": HELLO, "epoch": os.urandom(8).hex(), "pool": pool, "instance": instance,
            "root": cache.root.hex(), "block_size": block_size,
            "capacity_blocks": capacity_blocks,
        }  # fmt: skip
        self.load = load
        self.heartbeat_s = heartbeat_s
        self._digest = _digest(token)
        self._sock = socket.create_server((host, port), backlog=64)
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._load_version = 0  # bumped by nudge(): the load goes out before the heartbeat
        cache.publish(self.log.append)

    def nudge(self) -> None:
        """The load changed (a sequence joined or left): send it now, not a heartbeat later,
        so a frontend's next choice does not see a finished request's KV still reserved."""
        self._load_version += 1
        self.log.wake()

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._conns)

    def start(self) -> Publisher:
        threading.Thread(target=self._accept, name="kv-events", daemon=True).start()
        return self

    def close(self) -> None:
        """Stop publishing: subscribers see their streams end at once (as when the process
        exits), so frontends stop sending here before this server is gone."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5.0)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                raw = _recv_exact(conn, len(PROTO) + 32)
                if raw[:4] != PROTO or not hmac.compare_digest(raw[4:], self._digest):
                    return
                with self._lock:
                    self._conns.add(conn)
                send_frame(conn, self.hello)
                self._stream(conn)
            except (OSError, ProtocolError) as e:
                log.debug("a KV event subscriber left: %s", e)
            except Exception:  # a bug: the subscriber reconnects, and it shows in the log
                log.exception("streaming KV events failed")
            finally:
                with self._lock:
                    self._conns.discard(conn)

    def _snapshot(self, conn: socket.socket) -> int:
        seq, hashes = self.cache.snapshot(lambda: self.log.seq)
        send_frame(conn, {"t": SNAPSHOT, "seq": seq, "blocks": [h.hex() for h in hashes]})
        return seq

    def _stream(self, conn: socket.socket) -> None:
        cursor, beat, sent = self._snapshot(conn), 0.0, -1
        while not self._stop.is_set():
            now, version = time.monotonic(), self._load_version
            if now - beat >= self.heartbeat_s or version != sent:
                beat, sent = now, version
                send_frame(conn, {"t": LOAD, **(self.load() if self.load else {})})
            events = self.log.since(cursor, self.heartbeat_s)  # (a nudge wakes it too)
            if events is None:  # fell behind what the log keeps
                cursor = self._snapshot(conn)
                continue
            for seq, kind, blocks in events:
                send_frame(conn, {"t": kind, "seq": seq, "blocks": blocks})
                cursor = seq


# ------------------------------------------------------------------ subscriber (frontend)


class Sink(Protocol):
    """Where a subscriber's news goes (remote/cache_route.py InstanceView)."""

    def hello(self, message: dict[str, Any]) -> None: ...

    def snapshot(self, blocks: list[bytes]) -> None: ...

    def event(self, kind: str, blocks: list[bytes]) -> None: ...

    def heartbeat(self, load: dict[str, Any]) -> None: ...

    def lost(self, why: str) -> None:
        """The stream ended (or went silent): whatever was known of the instance is void."""
        ...


class Subscriber:
    """Follows one instance's events on a thread of its own, reconnecting every `retry_s`
    while it is unreachable. `on_lost(why)` hears when a stream that was up ends."""

    def __init__(
        self,
        address: str,
        token: str,
        sink: Sink,
        on_lost: Callable[[str], None] | None = None,
        timeout_s: float = 1.0,
        retry_s: float = 0.5,
    ) -> None:
        self.address = address
        self.token = token
        self.sink = sink
        self.on_lost = on_lost
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.live = False
        self._stop = threading.Event()
        self._conn: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-events {address}", daemon=True)

    def start(self) -> Subscriber:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
                why = "stopped"
            except (OSError, ProtocolError, ValueError, KeyError, TypeError) as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if self.live:
                self.live = False
                self.sink.lost(why)
                if not self._stop.is_set():
                    log.warning("KV events of %s lost (%s)", self.address, why)
                    if self.on_lost is not None:
                        try:
                            self.on_lost(why)
                        except Exception:  # never the end of following it
                            log.exception("on_lost of %s failed", self.address)
            self._stop.wait(self.retry_s)

    def _follow(self) -> None:
        host, _, port = self.address.rpartition(":")
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout_s)
        self._conn = conn
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(PROTO + _digest(self.token))
            hello = recv_frame(conn)
            if hello["t"] != HELLO:
                raise ProtocolError(f"expected hello, got {hello['t']!r}")
            self.sink.hello(hello)
            seq = None
            while not self._stop.is_set():
                m = recv_frame(conn)  # the socket timeout: silence for timeout_s ends it
                kind = m["t"]
                if kind == SNAPSHOT:
                    seq = int(m["seq"])
                    self.sink.snapshot([bytes.fromhex(h) for h in m["blocks"]])
                    if not self.live:
                        self.live = True
                        log.info("following the KV events of %s", self.address)
                elif kind in (STORED, REMOVED):
                    if seq is None or int(m["seq"]) != seq + 1:
                        raise ProtocolError(f"event {m['seq']} after {seq}")
                    seq = int(m["seq"])
                    self.sink.event(kind, [bytes.fromhex(h) for h in m["blocks"]])
                elif kind == LOAD:
                    self.sink.heartbeat({k: v for k, v in m.items() if k != "t"})


def instance_index(instance_name: str) -> int:
    """i of a Triton model instance named `<model>_<group>_<i>` (0 when it says none)."""
    tail = instance_name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def publish(
    cache: Cache | None,
    token: str,
    *,
    pool: str,
    instance_name: str,
    host: str,
    port: int,
    block_size: int,
    capacity_blocks: int,
    load: Callable[[], dict[str, int]] | None = None,
) -> Publisher | None:
    """A pool instance's publisher, started on `port` + its index; None without a prefix
    cache or with port 0 (events off)."""
    if cache is None or not port:
        return None
    i = instance_index(instance_name)
    return Publisher(
        cache, token, pool=pool, instance=i, block_size=block_size,
        capacity_blocks=capacity_blocks, host=host, port=port + i, load=load,
    ).start()  # fmt: skip
