"""Locate the tritonserver shipped in the nvidia-pytriton wheel and lay out a backend directory.

The wheel carries `tritonserver`, the Python backend library and one backend stub per Python
version; Triton wants the stub next to the backend library, so we build a backend directory
of links: <dir>/python/{libtriton_python.so, triton_python_backend_stub,
triton_python_backend_utils.py}.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from disagg.errors import ConfigError


@dataclass(frozen=True)
class TritonInstall:
    server: Path  # the tritonserver binary
    libs: Path  # shared libraries the binary needs (LD_LIBRARY_PATH)
    backend_dir: Path  # what --backend-directory gets


def find_pytriton() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("nvidia-pytriton is not installed: pip install nvidia-pytriton")
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


def prepare(backend_dir: Path) -> TritonInstall:
    root = find_pytriton()
    server = root / "bin" / "tritonserver"
    libs = root.parent.parent / "nvidia_pytriton.libs"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    backend = root / "backends" / "python"
    for path in (server, libs, stub, backend / "libtriton_python.so"):
        if not path.exists():
            raise ConfigError(f"{path} missing from nvidia-pytriton (Python {version})")
    target = backend_dir / "python"
    target.mkdir(parents=True, exist_ok=True)
    for src in (backend / "libtriton_python.so", stub, backend / "triton_python_backend_utils.py"):
        link = target / src.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return TritonInstall(server=server, libs=libs, backend_dir=backend_dir)


def server_env(install: TritonInstall, extra_pythonpath: list[Path]) -> dict[str, str]:
    """Environment for tritonserver: its libraries, and this venv first on PATH, since the
    Python backend stub takes its interpreter environment from the server process."""
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(Path(sys.executable).parent.parent)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in [str(install.libs), env.get("LD_LIBRARY_PATH", "")] if p
    )
    # OMP_WAIT_POLICY is left at OpenMP's default (spin briefly, then sleep). Measured on
    # 2 cores (docs/benchmarks.md): ACTIVE lets idle threads of one model process starve
    # the others (served throughput fell to 10%); PASSIVE slows every decode step by 15-35%.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in extra_pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return env


def from_settings(server: str, backends: str, backend_dir: Path) -> TritonInstall:
    """NVIDIA's tritonserver (in its container) when `server` is set, else nvidia-pytriton's."""
    if not server:
        return prepare(backend_dir)
    binary, backends_dir = Path(server), Path(backends or Path(server).parents[1] / "backends")
    for path in (binary, backends_dir / "python"):
        if not path.exists():
            raise ConfigError(f"{path} not found (settings triton_server / triton_backends)")
    return TritonInstall(server=binary, libs=binary.parent, backend_dir=backends_dir)
