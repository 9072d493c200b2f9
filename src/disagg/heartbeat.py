"""A stub's sign of life that only running Python can give.

python_backend's decoupled BLS can deadlock a stub for good (docs/reliability.md, "A stub
whose Python stops"): a thread holding the GIL waits in C++ for a lock that a thread
waiting for the GIL holds, and every other thread of the process waits for the GIL. The
process stays alive, its sockets open, and the supervisor's death checks see nothing. So
each model's stub touches a file named after its pid from a thread of its own; that thread
needs the GIL, and the supervisor (serve/supervisor.py) treats a stub whose file stops
changing as wedged."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

INTERVAL_S = 1.0


def path_of(directory: str | Path, pid: int) -> Path:
    return Path(directory) / str(pid)


def start(
    directory: str | Path, interval_s: float = INTERVAL_S, stop: threading.Event | None = None
) -> threading.Thread:
    """Touches <directory>/<this pid> every `interval_s` from a daemon thread, the first
    time before returning, until `stop` is set (a stub's: until it exits). Start it once a
    model's initialize has loaded everything: a stub that never beat is not judged."""
    path = path_of(directory, os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    stopped = stop or threading.Event()

    def run() -> None:
        while not stopped.wait(interval_s):
            with contextlib.suppress(OSError):  # (the run directory gone: the server stops)
                path.touch()

    thread = threading.Thread(target=run, name="heartbeat", daemon=True)
    thread.start()
    return thread
