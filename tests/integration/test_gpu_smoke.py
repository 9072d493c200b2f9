"""deploy/gpu_smoke.sh without a GPU: its preflight fails naming the step, and its serve-and-
request half (SMOKE_CPU=1: disagg's CPU engine in place of TensorRT-LLM) passes end to end on
a real server, gateway and gRPC, under the environment compose gives its services. The GPU
half (build with TensorRT-LLM, serve on GPUs) has not run here: no GPU, no TensorRT-LLM
(docs/gpu.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "gpu_smoke.sh"


def smoke(tmp_path, **env) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "PATH": path, "SMOKE_WORK": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_without_a_gpu_the_smoke_test_fails_at_its_first_step(tmp_path):
    bare = tmp_path / "bin"  # a PATH with python but no nvidia-smi
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    r = subprocess.run(
        ["bash", str(SCRIPT)],
        env={"PATH": f"{bare}:/usr/bin:/bin", "SMOKE_WORK": str(tmp_path), "HOME": "/tmp"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "FAILED at step: preflight: nvidia-smi" in r.stderr


def test_the_serve_and_request_half_passes_on_the_cpu_engine(tmp_path, engine_dir):
    """Run as compose's services would run it (their environment turns the gateway off and
    leaves the mode to `auto`, which on a shared machine picks conditional and keeps these
    short prompts co-located): the script serves its own gateway and sends every prompt
    through prefill, the same way in both halves, so the hand-off check holds."""
    r = smoke(tmp_path, SMOKE_CPU="1", DISAGG_ENGINE_DIR=str(engine_dir),
              DISAGG_GATEWAY_ENABLED="false", DISAGG_MODE="auto")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "== mode disaggregated, ports on 127.0.0.1" in r.stderr
    for step in ("gateway non-streamed", "gateway streamed", "triton grpc non-streamed",
                 "triton grpc streamed", "kv hand-off metric"):  # fmt: skip
        assert f"ok: {step}" in r.stdout, r.stdout
    assert "smoke passed" in r.stderr
