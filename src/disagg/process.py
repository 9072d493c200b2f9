"""Whether another process on this host is alive, and whether it is a Python backend stub,
from /proc (no Triton, no psutil)."""

from __future__ import annotations

import ctypes
import os
import signal

PF_EXITING = 0x4  # the kernel's per-task flag, set when do_exit() begins
SIGKILL_BIT = 1 << (9 - 1)
STUB = "triton_python_backend_stub"


def stub_args(pid: int) -> list[bytes] | None:
    """The command line of `pid` ([stub, model.py, shared memory region, ...]) when it is a
    Python backend stub; None for any other process, or none at all."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return None
    return args if len(args) > 2 and args[0].endswith(STUB.encode()) else None


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat from its third field on (the state letter first): the name in field
    2 may hold spaces, so the split starts after its closing parenthesis. Raises OSError
    when there is no such process."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_alive(pid: int) -> bool:
    """Whether a process on this host is running and not on its way out: a zombie, a
    process in its exit path (that of a stub with gigabytes mapped takes a while), or one
    with a SIGKILL pending counts as dead. A response sent to a stub in that window is never
    read, and the send can block."""
    try:
        fields = stat_fields(pid)
        if fields[0] in ("Z", "X") or int(fields[6]) & PF_EXITING:  # field 9: flags
            return False
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) & (
                    SIGKILL_BIT
                ):
                    return False
        return True
    except (OSError, ValueError, IndexError):
        return False


PARENT_ENV = "DISAGG_PARENT_PID"  # set by a parent whose children end with it (cluster.py)


def exit_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Called by a child at its start: the kernel sends it `sig` when the thread that started
    it ends, so a parent killed outright leaves no child running (Linux's PR_SET_PDEATHSIG;
    elsewhere nothing). A parent that died before this call is caught by its pid."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
