"""K/V hand-offs between the pools of one server through files in shared memory.

Within one server the payload used to travel as a Triton tensor: the prefill stub packed it,
tritonserver copied it to the orchestrator's stub, which sent it on to decode's, copied
again (74 MB for a 1,600-token prompt in fp32). Those copies run on the server's threads
that also carry decode's token responses to the orchestrator: on a busy 2-core box the
running streams' tokens waited 340-450 ms behind each hand-off (docs/benchmarks.md). Now
the prefill process packs the payload into a file under /dev/shm and the tensor carries a
reference of a few dozen bytes; decode maps the file, unlinks it, and copies the K/V
straight into its slot.

    prefill:  ShmHandoffs.write -> ShmRef (bytes in the response)
    decode:   open_payload(ref) -> the payload's bytes (the file is gone from the directory)
    nobody:   ShmHandoffs.drop (its client left) or the TTL (an orchestrator that died)

Files are the owner's only (0600), named by 128 random bits; a reference naming anything
else is refused. Where /dev/shm is missing, full, or over the byte budget, the payload
travels inline as before.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg.errors import KVPayloadError

log = logging.getLogger("disagg.kvshm")
REF_MAGIC = b"DISAGG-KVSHM1\n"
SHM_DIR = "/dev/shm"
_NAME = re.compile(r"disagg-kv-[0-9a-f]{32}")


@dataclass(frozen=True)
class ShmRef:
    """A payload in a file of this host's shared memory."""

    path: str
    nbytes: int

    def to_bytes(self) -> bytes:
        return REF_MAGIC + json.dumps({"path": self.path, "nbytes": self.nbytes}).encode()

    @classmethod
    def parse(cls, data: bytes | memoryview) -> ShmRef | None:
        """The reference in `data`, or None when `data` is something else (a payload)."""
        if bytes(data[: len(REF_MAGIC)]) != REF_MAGIC:
            return None
        try:
            body = json.loads(bytes(data[len(REF_MAGIC) :]))
            ref = cls(str(body["path"]), int(body["nbytes"]))
        except (ValueError, KeyError, TypeError) as e:
            raise KVPayloadError(f"KV shared-memory reference unreadable: {e}") from e
        head, name = os.path.split(ref.path)
        if head != SHM_DIR or not _NAME.fullmatch(name) or ref.nbytes < 0:
            raise KVPayloadError("KV shared-memory reference malformed")
        return ref


def open_payload(ref: ShmRef) -> memoryview:
    """The payload's bytes, mapped (no copy); the file leaves the directory at once, its
    memory when the last view of it goes. Any failure is a KVPayloadError (the orchestrator
    then has decode prefill the prompt itself)."""
    name = os.path.basename(ref.path)
    try:
        fd = os.open(ref.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:  # expired (TTL), dropped, or written on another host
        raise KVPayloadError(f"KV payload {name} is gone: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise KVPayloadError(f"KV payload {name} is not a file of this user")
        unlink(ref)  # (read once: nobody else needs its name)
        if st.st_size != ref.nbytes:
            raise KVPayloadError(f"KV payload {name} has {st.st_size} bytes, not {ref.nbytes}")
        if ref.nbytes == 0:
            return memoryview(b"")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # page tables here, not
        return memoryview(mmap.mmap(fd, ref.nbytes, flags, mmap.PROT_READ))  # in decode's step
    except OSError as e:  # (mmap: ENOMEM)
        raise KVPayloadError(f"KV payload {name} unreadable: {e}") from e
    finally:
        os.close(fd)


def unlink(ref: ShmRef) -> bool:
    """Free a payload nobody will read: whether it was still there."""
    try:
        os.unlink(ref.path)
    except FileNotFoundError:
        return False
    return True


class ShmHandoffs:
    """One prefill process's payloads in shared memory: at most `capacity_bytes` not yet
    read by decode, each unlinked after `ttl_s` if nobody read it (a thread sweeps them),
    and never so many that less than `reserve_bytes` of /dev/shm stays free: Triton's Python
    backend keeps its own stubs' shared memory there. Thread-safe."""

    def __init__(self, capacity_bytes: int, ttl_s: float, reserve_bytes: int = 256 << 20) -> None:
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.reserve_bytes = reserve_bytes
        self._held: dict[str, tuple[int, float]] = {}  # path -> (bytes, written at)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._sweeper, name="kvshm-sweep", daemon=True).start()

    @classmethod
    def open(cls, capacity_bytes: int, ttl_s: float) -> ShmHandoffs | None:
        """None where this host has no writable shared-memory directory. Files of this user
        older than the TTL (left by a process that died) are removed first."""
        if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)):
            return None
        for entry in os.scandir(SHM_DIR):
            try:
                st = entry.stat(follow_symlinks=False)
                old = time.time() - st.st_mtime > ttl_s
                if _NAME.fullmatch(entry.name) and st.st_uid == os.getuid() and old:
                    os.unlink(entry.path)
            except OSError:  # (gone meanwhile)
                continue
        return cls(capacity_bytes, ttl_s)

    def write(self, nbytes: int, fill: Callable[[np.ndarray[Any, Any]], Any]) -> ShmRef | None:
        """A file of `nbytes` that `fill` writes (given it as a uint8 array); None when it
        cannot be had (budget, space): the caller sends the payload inline."""
        path = os.path.join(SHM_DIR, f"disagg-kv-{secrets.token_hex(16)}")
        with self._lock:  # (its bytes count from here: concurrent writers see them)
            if self._sweep() + nbytes > self.capacity_bytes or not self._room(nbytes):
                return None
            self._held[path] = (nbytes, time.monotonic())
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self._forget(path)
            log.warning("no shared-memory file for a KV payload (%s): sent inline", e)
            return None
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)  # ENOSPC here, not SIGBUS on a write below
                # (unmapped when the last view of it goes: `fill` may return one, and a
                # traceback holds one until the caller is done with the error)
                fill(np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED), np.uint8))
        except OSError as e:
            self.drop(ShmRef(path, nbytes))
            log.warning("KV payload of %d MB not written (%s): sent inline", nbytes >> 20, e)
            return None
        except BaseException:
            self.drop(ShmRef(path, nbytes))
            raise
        finally:
            os.close(fd)
        with self._lock:  # (again: a sweep while it was written found no file yet)
            self._held[path] = (nbytes, time.monotonic())
        return ShmRef(path, nbytes)

    def drop(self, ref: ShmRef) -> bool:
        self._forget(ref.path)
        return unlink(ref)

    def held_bytes(self) -> int:
        with self._lock:
            return self._sweep()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            paths, self._held = list(self._held), {}
        for path in paths:
            unlink(ShmRef(path, 0))

    def _forget(self, path: str) -> None:
        with self._lock:
            self._held.pop(path, None)

    def _room(self, nbytes: int) -> bool:
        """Whether /dev/shm keeps `reserve_bytes` free after `nbytes` more."""
        try:
            st = os.statvfs(SHM_DIR)
        except OSError:
            return False
        free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        return free - nbytes >= min(self.reserve_bytes, size // 4)

    def _sweeper(self) -> None:
        while not self._closed.wait(max(min(5.0, self.ttl_s / 2), 0.05)):
            self.held_bytes()

    def _sweep(self) -> int:
        """Forget the files decode took, unlink the expired ones: the bytes still held."""
        now, held = time.monotonic(), 0
        for path, (nbytes, at) in list(self._held.items()):
            if not os.path.exists(path):
                del self._held[path]
            elif now - at > self.ttl_s:
                del self._held[path]
                if unlink(ShmRef(path, nbytes)):
                    log.info("KV payload %s unread after %.0f s: freed", path, self.ttl_s)
            else:
                held += nbytes
        return held
