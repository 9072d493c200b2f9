"""What the doctor's checks probe, behind one class the tests replace method by method."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from disagg import contracts as C
from disagg.serve import shm_regions
from disagg.settings import ServeSettings


class System:
    """The machine, as the checks see it (tests replace each method)."""

    def which(self, name: str) -> str | None:
        return shutil.which(name)

    def run(self, cmd: list[str], timeout_s: float = 10) -> tuple[int, str]:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            return 127, str(e)
        return p.returncode, (p.stdout + p.stderr).strip()

    def shm_free_bytes(self) -> int | None:
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def stale_stub_regions(self, older_than_s: float = 60.0) -> list[tuple[str, int]]:
        """This user's Python backend regions in /dev/shm that no process maps or holds
        open, as (name, bytes): what stubs of servers killed with SIGKILL leave."""
        return shm_regions.stale(older_than_s)

    def remove_shm(self, name: str) -> None:
        shm_regions.remove(name)

    def port_in_use(self, host: str, port: int) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return True
        return False

    def http_get(self, url: str, timeout_s: float = 3) -> int | None:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def tensorrt_llm(self) -> tuple[str, set[str]] | None:
        """The installed TensorRT-LLM's version and LLM-API field names, or None."""
        try:
            import tensorrt_llm
            from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
        except Exception:  # not installed, or its import fails (a version clash)
            return None
        return tensorrt_llm.__version__, set(TorchLlmArgs.model_fields)

    def stub_libpython(self) -> str | None:
        """The libpython the nvidia-pytriton stub loads, from ldd."""
        from disagg.serve.triton_install import find_pytriton

        try:
            v = f"{sys.version_info.major}.{sys.version_info.minor}"
            stub = find_pytriton() / "python_backend_stubs" / v / "triton_python_backend_stub"
        except Exception:
            return None
        rc, out = self.run(["ldd", str(stub)])
        for line in out.splitlines():
            if "libpython" in line and "=>" in line:
                return line.split("=>")[1].split("(")[0].strip()
        return None

    def ttft_s(self, settings: ServeSettings) -> float:
        from disagg.client import HttpClient

        http = HttpClient(f"http://{settings.host}:{settings.http_port}", timeout_s=60)
        start = time.perf_counter()
        first: list[float] = []

        def on_delta(_: str) -> None:
            if not first:
                first.append(time.perf_counter())

        http.generate(
            "router", {C.TEXT_INPUT: "Hello", C.MAX_TOKENS: 2}, stream=True, on_delta=on_delta
        )
        return (first[0] if first else time.perf_counter()) - start
