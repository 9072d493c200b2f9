"""A command's output read as it comes (waited on by text), and a child found by name."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path


class OutputLines:
    """Every line of `proc`'s stdout (text mode), with when it came, read on a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait(self, text: str, timeout_s: float) -> tuple[float, str]:
        """(when, the line) of the first line holding `text`, waiting up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if text in line:
                    return t, line
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} in {timeout_s:.0f} s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def child(parent: int, name: str) -> int:
    """The pid of `parent`'s child process called `name`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            if int(fields[1].split()[1]) == parent and fields[0].endswith("(" + name[:15]):
                return int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no child {name!r} of {parent}")
