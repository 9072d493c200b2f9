"""Overwrite a secret in a child process's command line once the child has read it.

tritonserver takes the key of its restricted APIs only as a command-line value
(`--http-restricted-api=<apis>:<header>=<key>`), and /proc/<pid>/cmdline, which `ps` shows,
is readable by every local user (unlike /proc/<pid>/environ). Triton copies its options into
strings while it parses them, before it writes its first log line, and never reads argv
again; so once the log has a line, the parent overwrites the key's bytes in the child's argv
through /proc/<pid>/mem (a parent may write its own child's memory; the same rewrite of
argv that setproctitle does from inside). The key is visible for the few milliseconds
between exec and that first line; on hosts shared with untrusted users mount /proc with
hidepid=2 as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from disagg.process import stat_fields

MASK = b"*"


def _argv_range(pid: int) -> tuple[int, int]:
    # /proc/<pid>/stat: fields 48 and 49 (1-based) are arg_start and arg_end (stat_fields
    # starts at field 3)
    fields = stat_fields(pid)
    return int(fields[48 - 3]), int(fields[49 - 3])


def mask_args(pid: int, secrets: list[str]) -> int:
    """Overwrite every occurrence of each secret in `pid`'s argv with '*'; returns how many
    were overwritten. Raises OSError where the kernel refuses (ptrace restrictions)."""
    start, end = _argv_range(pid)
    count = 0
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        args = mem.read(end - start)
        for secret in (s.encode() for s in secrets if s):
            i = args.find(secret)
            while i >= 0:
                mem.seek(start + i)
                mem.write(MASK * len(secret))
                count += 1
                i = args.find(secret, i + len(secret))
    return count


def mask_when(
    pid: int,
    secrets: list[str],
    is_parsed: Callable[[], bool],
    timeout_s: float = 30.0,
    poll_s: float = 0.002,
) -> int:
    """Wait until `is_parsed()` says the child has read its options, then mask_args."""
    deadline = time.monotonic() + timeout_s
    while not is_parsed() and time.monotonic() < deadline:
        time.sleep(poll_s)
    return mask_args(pid, secrets)
