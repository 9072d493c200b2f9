"""The machine a profile was measured on: CPU model and the flags that decide its kernels,
cores, memory, GPU, library versions. Enough to tell whether a profile stands for another
machine (same CPU and flags, same cores, same GPU) without trusting a hostname."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from disagg.cpuinfo import read_cpuinfo

# the instruction sets torch's CPU kernels choose by (fp32 / bf16 / int8 matmuls)
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")


def cpu_info(text: str | None = None) -> tuple[str, list[str]]:
    """(CPU model name, FLAGS it has) from /proc/cpuinfo (`text` for tests)."""
    info = read_cpuinfo(text)
    if info is None:
        return platform.processor() or platform.machine(), []
    model, flags = info
    return model or platform.machine(), [f for f in FLAGS if f in flags]


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def describe(device: str = "cpu") -> dict[str, Any]:
    """This machine, as a profile records it. Imports torch (the profiler has it loaded)."""
    import numpy as np
    import torch

    model, flags = cpu_info()
    out: dict[str, Any] = {
        "cpu": model,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": memory_gib(),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "gpu": None,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        out["gpu"] = torch.cuda.get_device_name(index)
        out["gpu_memory_gib"] = round(
            torch.cuda.get_device_properties(index).total_memory / 2**30, 1
        )
        out["cuda"] = torch.version.cuda
    return out
