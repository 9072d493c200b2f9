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
import time
from pathlib import Path

INTERVAL_S = 1.0


def path_of(directory: str | Path, pid: int) -> Path:
    return Path(directory) / str(pid)


def start(directory: str | Path, interval_s: float = INTERVAL_S) -> threading.Thread:
    """Touches <directory>/<this pid> every `interval_s` from a daemon thread, the first
    time before returning."""
    path = path_of(directory, os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)

    def beat() -> None:
        path.touch()
        os.utime(path)  # (touch leaves the time alone on some filesystems when it exists)

    beat()

    def run() -> None:
        while True:
            time.sleep(interval_s)
            with contextlib.suppress(OSError):  # (the run directory gone: the server stops)
                beat()

    thread = threading.Thread(target=run, name="heartbeat", daemon=True)
    thread.start()
    return thread
