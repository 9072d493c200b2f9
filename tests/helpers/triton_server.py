"""Start a real tritonserver on loopback for a test module (tests/ is on sys.path)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from disagg.serve.server import free_ports


def free_port_base(first: int, count: int, step: int = 300) -> int:
    """The first of `first`, `first + step`, ... below 60000 with `count` free ports from it
    (a `disagg cluster --base-port` range)."""
    import socket

    for base in range(first, 60000, step):
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} free ports from {first}")


def server_settings(engine_dir, build_dir, **overrides):
    """Test settings: free ports, small limits (sized for this machine beside a test run),
    and the disaggregated pipeline unless a test asks for another mode: what the tests check
    is the prefill/decode separation. The default mode ("auto": co-located on one machine)
    is served by tests/integration/test_serve_cli.py and resolved in tests/unit."""
    from disagg.settings import ServeSettings

    http, grpc, metrics = free_ports(3)
    overrides.setdefault("mode", "disaggregated")
    return ServeSettings(
        engine_dir=str(engine_dir),
        build_dir=str(build_dir),
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        decode_max_num_seqs=8,
        max_tokens_limit=512,
        **overrides,
    )


def start_server(engine_dir, build_dir, **overrides):
    return start_with(server_settings(engine_dir, build_dir, **overrides))


def start_with(settings):
    """A tritonserver of these settings, ready (stopped again if it never gets ready)."""
    from disagg.serve.server import TritonServer

    server = TritonServer(settings, admin_key="test-admin-key")
    server.start()
    try:
        ready_or_once_more(server)
    except BaseException:
        server.stop()
        raise
    return server


# tritonserver's own death when a stub is killed while it holds one of the Python backend's
# shared-memory locks: "terminate called after throwing an instance of
# 'boost::interprocess::lock_exception'" from libtriton_python.so (seen in CI at a decode and
# at an orchestrator kill: docs/reliability.md). Upstream's crash, not ours: `disagg serve`
# answers it by starting tritonserver again (tests/integration/test_serve_cli.py kills
# tritonserver and checks that).
UPSTREAM_ABORT = "boost::interprocess::lock_exception"


def _log_size(server) -> int:
    try:
        return server.log_path.stat().st_size
    except OSError:
        return 0


def died_of_upstream_abort(server, since: int = 0, wait_s: float = 10.0) -> bool:
    """Whether tritonserver exited of UPSTREAM_ABORT: the log written after byte `since` names
    it (stubs write to the same log: an older line must not count) and the process ended by
    abort (SIGABRT, or 134 through a shell). It is given `wait_s` to finish dying, since
    clients see their connections close as it goes."""
    try:
        with open(server.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    if UPSTREAM_ABORT not in text or server.proc is None:
        return False
    try:
        code = server.proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return False
    return code in (-signal.SIGABRT, 128 + signal.SIGABRT)


def ready_or_once_more(server, timeout_s: float = 240) -> None:
    """Wait until a just started server is ready; if it died of UPSTREAM_ABORT while
    loading (a CI run saw it at a start, with no stub killed), start it once more. Any other
    failure, or that abort twice, is raised."""
    try:
        server.wait_ready(timeout_s=timeout_s)
        return
    except RuntimeError:  # (wait_ready's "tritonserver exited")
        if not died_of_upstream_abort(server):
            raise
    import warnings

    warnings.warn(f"tritonserver died of {UPSTREAM_ABORT} while starting: again", stacklevel=2)
    server.stop()
    server.start()
    server.wait_ready(timeout_s=timeout_s)


def once_more_if_upstream_aborted(server, case):
    """Run `case()` (a fault case that kills stubs of a bare TritonServer, which, unlike
    `disagg serve`, restarts nothing); if tritonserver died of UPSTREAM_ABORT during it,
    start the server again and run the case once more. Any other death, or that abort twice,
    still fails the test. (An abort after the case returned is not seen here: the next test
    then meets a dead server and fails.)"""
    since = _log_size(server)
    got = case()
    if not died_of_upstream_abort(server, since):
        return got
    import warnings

    warnings.warn(f"tritonserver died of {UPSTREAM_ABORT} (upstream); case run again", stacklevel=2)
    server.stop()
    server.start()
    ready_or_once_more(server)
    since = _log_size(server)
    got = case()
    assert not died_of_upstream_abort(server, since), (
        f"{UPSTREAM_ABORT} twice:\n{server.log_tail()}"
    )
    return got


def metric(server, name: str, **labels) -> float:
    """The sum of a Prometheus metric's series on the server's metrics port, optionally only
    those with the given label values."""
    return scrape(server.endpoints.metrics, name, **labels)


def scrape(url: str, name: str, **labels) -> float:
    """The sum of the series of `name` (exact sample name) at a Prometheus endpoint whose
    labels include `labels`."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if (line.startswith(name + "{") or line.startswith(name + " "))
        and all(w in line for w in want)
    )


def eventually(check, timeout_s: float = 5.0) -> None:
    """Metric updates land a moment after the response (the models apply them on a thread
    of their own): retry the assertions in `check` until they hold or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def metric_becomes(server, name: str, value: float, timeout_s: float = 5.0, **labels) -> None:
    """Assert that a metric reaches `value` within the timeout."""

    def check():
        got = metric(server, name, **labels)
        assert got == value, f"{name}{labels} = {got}, expected {value}"

    eventually(check, timeout_s)


def admin_post(server, path: str, key: str | None) -> int:
    """HTTP status of a POST to one of Triton's admin (repository) APIs, e.g.
    "/v2/repository/models/prefill/unload", with `key` in the admin-key header."""
    import urllib.error

    req = urllib.request.Request(
        f"{server.endpoints.http}{path}",
        data=b"{}",
        headers={"admin-key": key} if key else {},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def serve_env(engine_dir, build_dir, **settings) -> tuple[dict, dict]:
    """The environment a `disagg serve`-like command runs with in a test: free ports, the
    engine, its own build directory, and `settings` as DISAGG_<NAME> (upper-cased).
    Returns (env, ports by name)."""
    import os

    http, grpc, metrics, gateway = free_ports(4)
    ports = {"http": http, "grpc": grpc, "metrics": metrics, "gateway": gateway}
    env = {
        **os.environ,
        "DISAGG_ENGINE_DIR": str(engine_dir),
        "DISAGG_BUILD_DIR": str(build_dir),
        **{f"DISAGG_{name.upper()}_PORT": str(port) for name, port in ports.items()},
        **{f"DISAGG_{k.upper()}": str(v) for k, v in settings.items()},
    }
    return env, ports


@contextlib.contextmanager
def openai_client(server, key: str) -> Iterator:
    """The official `openai` client of a gateway process in front of `server` (one key)."""
    import openai

    from disagg.serve.gateway_process import GatewayProcess

    (port,) = free_ports(1)
    gateway = GatewayProcess(
        replace(server.settings, gateway_port=port), env={"DISAGG_API_KEYS": key}
    ).start()
    try:
        gateway.wait_ready()
        yield openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    finally:
        gateway.stop()


@contextlib.contextmanager
def servers_under_token(token: str) -> Iterator[dict[str, Any]]:
    """A dict to put TritonServers in, with the internal token `token` in the environment
    they start with; on exit every TritonServer in it is stopped and the token restored."""
    from disagg.contracts import TOKEN_ENV
    from disagg.serve.server import TritonServer

    saved = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = token
    servers: dict[str, Any] = {}
    try:
        yield servers
    finally:
        for server in servers.values():
            if isinstance(server, TritonServer):
                server.stop()
        if saved is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = saved
