"""Cancellation that reaches another process: a directory of marker files.

The orchestrator cannot cancel a BLS stream it started (Triton 2.51's Python backend has no
cancel on a response iterator), and with several decode instances it cannot address the one
serving a request. So it marks the request id here, and every decode instance looks for
the ids it is serving between steps.

Ids form a hierarchy with dots (the scheme is in contracts.py): the orchestrator names a
request `<caller's id>.<hex>`, and a mark on the caller's id (the router's, say) cancels it
too, since the caller cannot know the id the orchestrator made. Ids that are not safe file
names are never marked or matched.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from disagg.contracts import SAFE_REQUEST_ID as _SAFE_ID


class CancelRegistry:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, request_id: str) -> Path:
        if not _SAFE_ID.match(request_id):
            raise ValueError(f"unsafe request id for the cancel registry: {request_id!r}")
        return self.directory / request_id

    def mark(self, request_id: str) -> None:
        self._path(request_id).touch()

    def is_marked(self, request_id: str) -> bool:
        """Whether this id or one it extends (`a` for `a.b`) is marked."""
        if _SAFE_ID.match(request_id) is None:
            return False
        parts = request_id.split(".")
        return any(
            (self.directory / ".".join(parts[:n])).exists() for n in range(len(parts), 0, -1)
        )

    def clear(self, request_id: str) -> None:
        if _SAFE_ID.match(request_id):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(request_id))
