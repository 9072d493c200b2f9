"""Python backend shared memory regions (/dev/shm) that no process uses any more.

Each stub gets a 64 MiB region; a clean shutdown removes it, and the stub supervisor removes
a dead stub's while its server runs. A server killed with SIGKILL (a pool server of a
cluster, a crashed host process, an operator's `pkill -9`) leaves its stubs' regions behind,
and a tmpfs file holds its RAM until removed: on the 24 GiB development machine 211 of them
(13 GiB) once left a test run short of memory. `disagg doctor` names them and
`--remove-stale-shm` removes them; a server sweeps them as it starts (serve/server.py).

Only this user's regions are considered, and only those older than a minute (a stub starting
now creates its region, then maps it) that no process maps or holds open."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("disagg.serve")
SHM_DIR = Path("/dev/shm")
STUB_REGION = "triton_python_backend_shm_region_"  # python_backend's name for a stub's region


def in_use(names: set[str]) -> set[str]:
    """Those of `names` (files in /dev/shm) that a process maps or holds open, as far as
    /proc shows this user (another user's processes are unreadable; their regions are not
    ours to remove)."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            text = (proc / "maps").read_text(errors="replace")
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone, or not ours
            continue
        for fd in fds:
            with contextlib.suppress(OSError):  # (closed since the listing)
                text += "\n" + os.readlink(fd)
        used |= {n for n in names if f"{SHM_DIR}/{n}" in text}
    return used


def stale(older_than_s: float = 60.0) -> list[tuple[str, int]]:
    """This user's stub regions that no process uses, as (name, bytes)."""
    found: dict[str, int] = {}
    now = time.time()
    for f in SHM_DIR.glob(STUB_REGION + "*"):
        with contextlib.suppress(OSError):  # (removed since the listing)
            st = f.stat()
            if st.st_uid == os.getuid() and now - st.st_mtime > older_than_s:
                found[f.name] = st.st_size
    if found:  # (a server start with nothing left behind reads no /proc)
        for name in in_use(set(found)):
            del found[name]
    return sorted(found.items())


def remove(name: str) -> None:
    (SHM_DIR / name).unlink(missing_ok=True)


def sweep(older_than_s: float = 60.0) -> int:
    """Remove the stale regions; returns the bytes freed (logged when any)."""
    gone = stale(older_than_s)
    for name, _ in gone:
        with contextlib.suppress(OSError):
            remove(name)
    freed = sum(size for _, size in gone)
    if gone:
        log.warning(
            "removed %d Python backend regions in /dev/shm that no process used (%d MiB): "
            "stubs of servers killed with SIGKILL leave them",
            len(gone), freed >> 20,
        )  # fmt: skip
    return freed
