"""A planned restart's hold on new requests (serve/recycle.py writes it, the gateway obeys).

While the file exists and the deadline written in it (epoch seconds) has not passed, the
gateway keeps each new request back instead of sending it to a tritonserver about to be
replaced, and sends it once the file is gone. Requests already sent are not touched: the
restart waits for them. A file left behind by a crash stops holding at its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

FILE = "triton_restart.hold"  # in the build directory


class Hold:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def in_dir(cls, build_dir: Path) -> Hold:
        """The hold of the server whose build directory this is (serve and its gateway)."""
        return cls(build_dir / FILE)

    def begin(self, seconds: float) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{time.time() + seconds:.3f}\n")
        os.replace(tmp, self.path)

    def end(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def active(self) -> bool:
        try:
            return time.time() < float(self.path.read_text())
        except (OSError, ValueError):
            return False

    async def wait(self, poll_s: float = 0.2) -> bool:
        """Until the hold ends; True when it held the caller at all."""
        if not self.active():
            return False
        while self.active():
            await asyncio.sleep(poll_s)
        return True
