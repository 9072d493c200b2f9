"""Run the gateway as its own process next to Triton (it can be restarted on its own), with
exactly the settings the serve command resolved, passed as DISAGG_* variables."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import fields
from pathlib import Path

from disagg.contracts import TOKEN_ENV
from disagg.settings import ENV_PREFIX, ROOT, ServeSettings


def settings_env(settings: ServeSettings) -> dict[str, str]:
    return {ENV_PREFIX + f.name.upper(): str(getattr(settings, f.name)) for f in fields(settings)}


class GatewayProcess:
    def __init__(self, settings: ServeSettings, env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.url = f"http://{settings.host}:{settings.gateway_port}"
        self.log_path = settings.path("build_dir") / "gateway.log"
        self.env = {**os.environ, **(env or {}), **settings_env(settings)}
        # the internal token is the models' (a cluster's serve processes hold it): the gateway
        # speaks only to the router, which takes none
        self.env.pop(TOKEN_ENV, None)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "src")] + ([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH") else [])
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> GatewayProcess:
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg", "gateway"],
            env=self.env,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"gateway not up after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.log_file.close()
