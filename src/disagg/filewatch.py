"""Noticing that a config file changed, cheaply enough to ask on every request."""

from __future__ import annotations

import time
from pathlib import Path


class FileWatch:
    """`changed()` says whether the file changed (mtime or size) since it last said so; it
    looks at most once per `every_s`."""

    def __init__(self, path: str | Path, every_s: float = 1.0) -> None:
        self.path = Path(path)
        self.every_s = every_s
        self._stamp = self._read()
        self._checked = time.monotonic()

    def _read(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
            return st.st_mtime_ns, st.st_size
        except OSError:
            return None

    def changed(self) -> bool:
        now = time.monotonic()
        if now - self._checked < self.every_s:
            return False
        self._checked = now
        stamp = self._read()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True
