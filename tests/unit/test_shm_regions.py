"""Stale Python backend regions in this machine's real /dev/shm (serve/shm_regions.py): what
a server sweeps as it starts and `disagg doctor --remove-stale-shm` removes."""

from __future__ import annotations

import mmap
import os
import time
import uuid
from pathlib import Path

import pytest

from disagg.serve import shm_regions

pytestmark = pytest.mark.unit


@pytest.fixture
def region():
    """A 1 MiB region file named as python_backend names them; removed afterwards."""
    made = []

    def make(age_s: float) -> Path:
        path = shm_regions.SHM_DIR / f"{shm_regions.STUB_REGION}test-{uuid.uuid4()}"
        with open(path, "wb") as f:
            f.truncate(1 << 20)
        then = time.time() - age_s
        os.utime(path, (then, then))
        made.append(path)
        return path

    yield make
    for path in made:
        path.unlink(missing_ok=True)


def test_a_sweep_removes_old_unused_regions_and_keeps_young_and_mapped_ones(region):
    old, young, mapped = region(600), region(0), region(600)
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 0):
        assert shm_regions.sweep() >= 1 << 20
        assert not old.exists()
        assert young.exists() and mapped.exists()
    assert (mapped.name, 1 << 20) in shm_regions.stale()  # no longer mapped


def test_a_region_held_open_but_not_mapped_is_in_use(region):
    held = region(600)
    with open(held, "rb"):
        assert held.name not in dict(shm_regions.stale())
    assert held.name in dict(shm_regions.stale())
