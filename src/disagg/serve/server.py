"""Start, watch and stop an embedded tritonserver serving disagg's repositories."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from disagg.contracts import ADMIN_HEADER, ADMIN_KEY_ENV, TOKEN_ENV
from disagg.contracts import internal_token as contracts_internal_token
from disagg.errors import ConfigError
from disagg.gateway.auth import KEYS_ENV
from disagg.process import stub_args
from disagg.serve import procargs, shm_regions, triton_install
from disagg.serve.render import render_repositories, role_models
from disagg.serve.supervisor import StubSupervisor
from disagg.settings import ROOT, ServeSettings, parse_cpus, template_values

log = logging.getLogger("disagg.serve")
# Triton APIs that change or inspect the server beyond inference: behind the admin key.
RESTRICTED_APIS = "model-repository,shared-memory,logging,trace"
SHM_BYTES = 64 * 2**20  # Python backend shared memory per stub: KV payloads are tens of MB
# The gateway's secrets (its API keys, and the admin key its /admin routes check): taken out of
# tritonserver's environment, which every stub inherits and none reads. Triton gets the admin
# key on its command line alone (masked there: procargs.py); the stubs keep the internal token.
GATEWAY_SECRETS = (KEYS_ENV, KEYS_ENV + "_FILE", ADMIN_KEY_ENV)


def _stub_shm_regions(session: int) -> list[str]:
    """Shared memory regions of the Python backend stubs in a server's process group."""
    regions = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.getpgid(int(proc.name)) != session:
                continue
        except (OSError, ProcessLookupError):
            continue
        if (args := stub_args(int(proc.name))) is not None:
            regions.append(args[2].decode())
    return regions


def _reap_children_automatically() -> None:
    """In the tritonserver child, before exec: SIGCHLD ignored, so the kernel reaps its dead
    children. Triton 2.51 does not wait for a stub that died (kill -9, segfault): each stayed
    a zombie until the server exited. The disposition survives exec; a stub's own children
    (none today) would be reaped the same way."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)


def _in_child(cpus: set[int]) -> None:
    _reap_children_automatically()
    if cpus:  # before exec, on the only thread: every thread and stub after inherits it
        os.sched_setaffinity(0, cpus)


_HANDED_OUT: set[int] = set()
_PORTS_LOCK = threading.Lock()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n ports nobody listens on right now and this process has not handed out before (for
    tests and benchmarks). A port handed out is not bound until its server starts, and the
    kernel may offer it again meanwhile: a CI run once gave two servers of one cluster the
    same port (a health check read the other's gRPC frames)."""
    with _PORTS_LOCK:
        socks: list[socket.socket] = []
        ports: list[int] = []
        try:
            while len(ports) < n:
                if len(socks) > 1000:
                    raise OSError(f"no {n} fresh ports on {host}")
                s = socket.socket()
                socks.append(s)  # held until the end: one call's ports differ
                s.bind((host, 0))
                port = s.getsockname()[1]
                if port not in _HANDED_OUT:
                    ports.append(port)
                    _HANDED_OUT.add(port)
        finally:
            for s in socks:
                s.close()
        return ports


@dataclass
class Endpoints:
    http: str
    grpc: str
    metrics: str


def internal_token(s: ServeSettings) -> str:
    """One server makes its own; the servers of a cluster must share one (a frontend calls the
    pools of the others, a decode server pulls KV from prefill servers with it)."""
    shared = contracts_internal_token()  # the environment's, if set
    if s.role == "all" and not (s.prefill_replicas or s.decode_replicas):
        return shared or secrets.token_hex(16)
    if len(shared) < 16:
        raise ConfigError(
            f"role {s.role!r} (or remote pools) needs {TOKEN_ENV}: the same secret of 16+ "
            "characters on every server of the deployment (e.g. openssl rand -hex 16)"
        )
    return shared


def check_pool_gpus(s: ServeSettings, count: Callable[[], int | None] | None = None) -> None:
    """TensorRT-LLM pools this server runs name only GPUs the machine has: else a pool's
    process sees no GPU, its load fails and `--exit-on-error` ends the whole server."""
    if s.engine_backend != "tensorrt_llm":
        return
    from disagg.trtllm import gpus

    local = role_models(s.role, s.prefill_replicas, s.decode_replicas)
    pools = [p for p in ("prefill", "decode") if p in local]
    named = {p: gpus.parse_devices(getattr(s, f"trtllm_{p}_devices"), p) for p in pools}
    if not any(named.values()):
        return
    num_gpus = (count or gpus.count_gpus)()
    for pool, ids in named.items():
        gpus.check_exist(
            ids, num_gpus, f"setting trtllm_{pool}_devices",
            f"set it (DISAGG_TRTLLM_{pool.upper()}_DEVICES or serve.toml) to GPUs that exist, "
            f"or rebuild with build_engines/build_trtllm_engine.py on this machine",
        )  # fmt: skip


class TritonServer:
    def __init__(self, settings: ServeSettings, admin_key: str | None = None) -> None:
        self.settings = settings
        self.admin_key = admin_key or os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(24)
        self.admin_key_generated = admin_key is None and ADMIN_KEY_ENV not in os.environ
        s = settings
        self.build_dir = s.path("build_dir")
        self.run_dir = self.build_dir / "run"
        self.log_path = self.build_dir / "tritonserver.log"
        self.endpoints = Endpoints(
            http=f"http://{s.host}:{s.http_port}",
            grpc=f"{s.host}:{s.grpc_port}",
            metrics=f"http://{s.host}:{s.metrics_port}/metrics",
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.supervisor: StubSupervisor | None = None

    def command(self, install: triton_install.TritonInstall, repos: list[Path]) -> list[str]:
        s = self.settings
        restricted = f"{RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}"
        return [
            str(install.server),
            *[f"--model-repository={r}" for r in repos],
            f"--backend-directory={install.backend_dir}",
            f"--http-address={s.host}",
            f"--http-port={s.http_port}",
            f"--grpc-address={s.host}",
            f"--grpc-port={s.grpc_port}",
            f"--metrics-address={s.host}",
            f"--metrics-port={s.metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            "--allow-cpu-metrics=true",
            "--model-control-mode=explicit",
            # our configs are complete; with auto-complete on, the Python backend starts a
            # stub per model load just to ask model.py for a config (torch and all imported:
            # ~3 s of every restart after a crash, docs/reliability.md)
            "--disable-auto-complete-config",
            "--load-model=*",
            "--strict-readiness=true",
            "--exit-on-error=true",
            f"--exit-timeout-secs={max(1, round(s.drain_s))}",
            f"--http-restricted-api={restricted}",
            f"--grpc-restricted-protocol={restricted}",
            f"--backend-config=python,shm-default-byte-size={SHM_BYTES}",
            f"--backend-config=python,shm-growth-byte-size={SHM_BYTES}",
            f"--log-verbose={s.log_verbose}",
        ]

    def start(self) -> TritonServer:
        engine_cfg = self.settings.path("engine_dir") / "config.json"
        if not engine_cfg.is_file():
            raise ConfigError(f"{engine_cfg} not found: build the engine first (make engine)")
        s = self.settings
        check_pool_gpus(s)
        install = triton_install.from_settings(
            s.triton_server, s.triton_backends, self.build_dir / "backends"
        )
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        shm_regions.sweep()  # what servers killed with SIGKILL left in /dev/shm (their RAM)
        models = role_models(s.role, s.prefill_replicas, s.decode_replicas)
        repos = [
            r
            for r in render_repositories(
                template_values(self.settings, self.run_dir), self.build_dir / "repository",
                models=models,
            )
            if any(r.iterdir())  # a pool server has no ensembles
        ]  # fmt: skip
        env = triton_install.server_env(install, [ROOT / "src"])
        for name in GATEWAY_SECRETS:
            env.pop(name, None)
        env[TOKEN_ENV] = internal_token(s)  # the internal models' token (contracts.py)
        self.log_file = self.log_path.open("w")
        self.proc = subprocess.Popen(
            self.command(install, repos),
            env=env,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_in_child, parse_cpus(s.cpus)),
        )
        self._mask_admin_key()
        return self

    def _mask_admin_key(self) -> None:
        """The admin key is on tritonserver's command line (its only way in): overwrite it
        there once Triton has parsed it, so `ps` does not show it (see procargs.py)."""
        proc = self.proc
        assert proc is not None, "start() first"
        try:
            procargs.mask_when(
                proc.pid,
                [self.admin_key],
                is_parsed=lambda: proc.poll() is not None or self.log_path.stat().st_size > 0,
            )
        except OSError as e:  # e.g. a kernel that forbids writing a child's memory
            if proc.poll() is None:
                log.warning("could not hide the admin key from tritonserver's command line: %s", e)

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoints.http}/v2/health/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every model is ready (at most the settings' startup budget), then start
        supervising the stub processes."""
        timeout_s = self.settings.startup_budget_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited ({self.proc.returncode}); log:\n{self.log_tail()}"
                )
            if self.is_ready():
                if self.supervisor is None:
                    assert self.proc is not None, "start() first"
                    self.supervisor = StubSupervisor(
                        self.proc.pid,
                        self.endpoints.http,
                        ADMIN_HEADER,
                        self.admin_key,
                        recover_timeout_s=self.settings.recover_timeout_s,
                        on_wedged=self._kill,
                        heartbeat_dir=self.run_dir / "heartbeat",
                        frozen_after_s=self.settings.stub_frozen_s,
                    ).start()
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"tritonserver not ready after {timeout_s:.0f} s; log:\n{self.log_tail()}"
        )

    def _kill(self, why: str = "") -> None:
        """End the server at once, stubs and all (a wedged model cannot be unloaded): whoever
        runs it sees it exit and starts it again (`disagg serve` does)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float | None = None) -> None:
        """Graceful shutdown (in-flight requests get `drain_s`); after a crash, also the stub
        processes and shared memory regions the dead server left behind. Safe to call twice;
        start() may follow."""
        timeout_s = self.settings.drain_s + 20.0 if timeout_s is None else timeout_s
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        if self.proc is None:
            return
        regions = _stub_shm_regions(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Triton's graceful shutdown
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        self.proc.wait()
        for name in regions:  # a clean shutdown removed them already
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
        self.log_file.close()
        self.proc = None

    def __enter__(self) -> TritonServer:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
