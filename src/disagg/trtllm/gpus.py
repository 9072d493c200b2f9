"""Which GPUs this machine has, and whether a pool's device list names only those.

A pool's `trtllm_<pool>_devices` becomes its process's CUDA_VISIBLE_DEVICES; an index the
machine lacks leaves the pool with no GPU, TensorRT-LLM cannot start, and with
`--exit-on-error` the whole server exits with an error far from its cause. So the build,
`disagg serve` (before tritonserver starts) and the pool's own process check the list first,
against nvidia-smi's count (which, unlike CUDA, ignores an inherited CUDA_VISIBLE_DEVICES:
the indexes are the machine's, as the pools use them; runtime.py sets CUDA_DEVICE_ORDER so
CUDA numbers them the same way)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from disagg.errors import ConfigError

Runner = Callable[[list[str]], tuple[int, str]]


def _run(cmd: list[str]) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    return p.returncode, p.stdout


def count_gpus(run: Runner = _run) -> int | None:
    """The GPUs nvidia-smi lists, or None where it is missing or fails (no driver here)."""
    rc, out = run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"])
    if rc != 0:
        return None
    return sum(1 for line in out.splitlines() if line.strip().isdigit())


def compute_capabilities(run: Runner = _run) -> list[tuple[int, int]] | None:
    """Each GPU's compute capability, (9, 0) for a Hopper, in nvidia-smi's order; None where
    nvidia-smi is missing, fails or answers something else (a driver without `compute_cap`)."""
    rc, out = run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    if rc != 0:
        return None
    caps: list[tuple[int, int]] = []
    for line in filter(None, (raw.strip() for raw in out.splitlines())):
        major, dot, minor = line.partition(".")
        if not (dot and major.isdigit() and minor.isdigit()):
            return None
        caps.append((int(major), int(minor)))
    return caps or None


def parse_devices(devices: str, what: str) -> list[int]:
    """ "0,1" -> [0, 1]; "" -> [] (whatever the process was started with)."""
    if not devices.strip():
        return []
    ids = [d.strip() for d in devices.split(",")]
    if not all(d.isdigit() for d in ids) or len(set(ids)) != len(ids):
        raise ConfigError(f"{what} {devices!r}: GPU indexes like 0 or 0,1")
    return [int(d) for d in ids]


def check_exist(devices: list[int], num_gpus: int | None, what: str, fix: str) -> None:
    """Refuse indexes this machine lacks (`num_gpus` None: no GPU could be counted)."""
    if not devices:
        return
    if num_gpus is None:
        raise ConfigError(
            f"{what} names GPU(s) {devices} but no NVIDIA GPU can be counted here "
            "(nvidia-smi is missing or fails): run on a GPU host, or in the TensorRT-LLM "
            "image with GPUs given to the container (compose reserves them; docker run "
            "--gpus all)"
        )
    missing = [d for d in devices if d >= num_gpus]
    if missing:
        have = "GPU 0 only" if num_gpus == 1 else f"GPUs 0-{num_gpus - 1}"
        raise ConfigError(
            f"{what} names GPU(s) {missing}, but this machine has {num_gpus} "
            f"({have if num_gpus else 'none'}): {fix}"
        )
