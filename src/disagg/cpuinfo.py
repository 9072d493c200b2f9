"""The CPU as /proc/cpuinfo tells it, read without torch: the serve command decides with it
before any pool loads, the planner records it with a profile, and the block kernels key
their build cache on it. One reader, so all three see the same flags."""

from __future__ import annotations

from pathlib import Path

# what the bf16 block products (engine/qbf16.c) need, said the same by the engine on load and
# by `disagg serve` before Triton starts
NO_BF16 = "needs a CPU with AVX512-BF16 (vdpbf16ps); this one has none: use float32 or int8"


def read_cpuinfo(text: str | None = None) -> tuple[str, list[str]] | None:
    """(model name, feature flags) of the first CPU listed (`text` for tests); None where
    /proc/cpuinfo cannot be read. x86 lists `flags`, ARM `Features`."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = value.split()
    return model, flags or []


def cpu_flags() -> str:
    """The flags as one string ("" where unknown): a build cache key and a onednn cap input."""
    info = read_cpuinfo()
    return " ".join(info[1]) if info else ""
