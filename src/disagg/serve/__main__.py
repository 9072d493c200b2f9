"""`disagg serve`: serve the model end to end on an embedded Triton (make serve)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from types import FrameType

from disagg.contracts import ADMIN_HEADER, ADMIN_KEY_ENV
from disagg.cpuinfo import NO_BF16, read_cpuinfo
from disagg.engine.config import QUANT_WEIGHTS_FILE
from disagg.errors import ConfigError
from disagg.gateway.auth import KEYS_ENV, key_hash, new_key, write_keys_file
from disagg.hold import Hold
from disagg.prefill_yield import prefill_yield
from disagg.process import PARENT_ENV, exit_with_parent
from disagg.serve import recycle
from disagg.serve.gateway_process import GatewayProcess
from disagg.serve.server import Endpoints, TritonServer
from disagg.settings import ROLES, ServeSettings


def first_api_key(settings: ServeSettings) -> str | None:
    """With auth on and no keys anywhere, make one: keep its hash, show it once."""
    if (
        not settings.gateway_enabled
        or not settings.gateway_auth
        or os.environ.get(KEYS_ENV)
        or os.environ.get(KEYS_ENV + "_FILE")
        or settings.keys_file.is_file()
    ):
        return None
    key = new_key()
    write_keys_file(settings.keys_file, [key_hash(key)])
    return key


MAX_CRASHES_PER_HOUR = 5


def restart_triton(server: TritonServer, crashes_this_hour: int) -> bool:
    """Triton died (a model bug can crash the whole server; see docs/gateway.md): keep its
    log, start it again. The gateway answers 503 meanwhile. Gives up after
    MAX_CRASHES_PER_HOUR."""
    kept = server.log_path.with_name(f"tritonserver.crash-{int(time.time())}.log")
    assert server.proc is not None, "it ran"
    print(
        f"tritonserver exited ({server.proc.returncode}); log kept as {kept}:\n"
        f"{server.log_tail(15)}",
        file=sys.stderr,
    )
    server.stop()
    server.log_path.replace(kept)
    if crashes_this_hour > MAX_CRASHES_PER_HOUR:
        print(f"{crashes_this_hour} crashes within an hour; not restarting", file=sys.stderr)
        return False
    print("restarting tritonserver ...", file=sys.stderr, flush=True)
    try:
        server.start()
        server.wait_ready()
    except (ConfigError, RuntimeError, TimeoutError) as e:
        print(f"error: restart failed: {e}", file=sys.stderr)
        return False
    print("tritonserver is back", file=sys.stderr, flush=True)
    return True


def recycle_triton(
    settings: ServeSettings,
    server: TritonServer,
    gateway: GatewayProcess,
    why: str,
    stopped: Callable[[], bool] = lambda: False,
) -> bool:
    """Replace a running tritonserver losing no gateway request (serve/recycle.py): hold new
    ones, drain the ones being served, restart, release. A stop asked for while draining
    ends the hold and leaves the server as it is."""
    print(f"replacing tritonserver: {why}", file=sys.stderr, flush=True)
    started = time.monotonic()
    hold = Hold.in_dir(settings.path("build_dir"))
    hold_s = settings.recycle_drain_s + settings.drain_s + settings.startup_budget_s + 60
    url = f"{gateway.url}/metrics" if settings.gateway_enabled else None
    left = recycle.drain(hold, url, settings.recycle_drain_s, hold_s, stopped)
    drained = time.monotonic() - started
    if stopped():
        hold.end()
        return True
    try:
        server.stop()
        server.start()
        server.wait_ready()
    except (ConfigError, RuntimeError, TimeoutError) as e:
        print(f"error: replacing tritonserver failed: {e}", file=sys.stderr)
        return False
    finally:
        hold.end()
    print(
        f"tritonserver replaced in {time.monotonic() - started:.1f} s (drained in {drained:.1f} s"
        + (f", {left:.0f} requests still running were cut" if left else "")
        + ")",
        file=sys.stderr,
        flush=True,
    )
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="disagg serve", description=__doc__)
    p.add_argument("--config", help="TOML settings file (env DISAGG_<SETTING> overrides it)")
    p.add_argument(
        "--role",
        choices=ROLES,
        help="all (default): the whole pipeline; frontend: gateway, router, orchestrator and "
        "the pools not set as replicas; prefill / decode: that pool alone (docs/scale-out.md)",
    )
    a = p.parse_args(argv)
    if parent := os.environ.pop(PARENT_ENV, ""):  # a node of `disagg cluster`: ends with it
        exit_with_parent(int(parent))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        settings = ServeSettings.load(a.config)
        if a.role:
            settings = replace(settings, role=a.role)
        if settings.role in ("prefill", "decode"):  # a pool server: clients go to the frontend
            settings = replace(settings, gateway_enabled=False)
        preflight(settings, _cpu_flags())
        server = TritonServer(settings)
        if not settings.is_loopback:
            print(
                f"warning: binding {settings.host}: Triton's inference API has no "
                "authentication; put the gateway in front of it",
                file=sys.stderr,
            )
        api_key = first_api_key(settings)
        print(f"starting tritonserver (log: {server.log_path}) ...", flush=True)
        server.start()
        server.wait_ready()
        # the gateway's admin API shares Triton's admin key
        gateway = GatewayProcess(settings, env={ADMIN_KEY_ENV: server.admin_key})
        if settings.gateway_enabled:
            gateway.start().wait_ready()
    except (ConfigError, RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        if "server" in locals():
            server.stop()
        return 2
    ep = server.endpoints
    if settings.role in ("prefill", "decode"):
        print(f"disagg {settings.role} server: gRPC {ep.grpc}, metrics {ep.metrics}", flush=True)
    else:
        print_banner(settings, gateway, ep)
    _serve_banner_extras(settings, server, api_key)
    return supervise(settings, server, gateway)


def _cpu_flags() -> list[str] | None:
    """The CPU's feature flags, read without torch (None where /proc/cpuinfo is not there)."""
    info = read_cpuinfo()
    return None if info is None else info[1]


def preflight(settings: ServeSettings, flags: list[str] | None) -> None:
    """What the pools would refuse only once Triton loads them, refused before it starts."""
    if (
        settings.decode_activations == "bfloat16"
        and settings.engine_backend == "pytorch"
        and settings.device == "cpu"
        and flags is not None
        and "avx512_bf16" not in flags
    ):
        raise ConfigError(f"decode_activations bfloat16 {NO_BF16}")


def _dtype(settings: ServeSettings) -> str:
    if settings.compute_dtype != "auto" or settings.engine_backend != "pytorch":
        return settings.compute_dtype
    if settings.device != "cpu":
        return "auto"
    flags = _cpu_flags()  # what the models decide with torch, read without it
    if flags is None:
        return "auto"
    native = any(f in flags for f in ("avx512_bf16", "amx_bf16"))
    return "auto: bfloat16" if native else "auto: float32"


def _weights(settings: ServeSettings) -> str:
    """What the pools' matmuls will read, told without loading torch: the engine's quantized
    blocks (their formats, from the safetensors header) or dense weights at a dtype."""
    dense = f"dense, compute dtype {_dtype(settings)}"
    if settings.weights != "auto":
        return f"{settings.weights} (dense)"
    if settings.engine_backend != "pytorch" or settings.device != "cpu":
        return dense
    path = settings.path("engine_dir") / QUANT_WEIGHTS_FILE
    try:
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        formats = sorted(set(json.loads(header["__metadata__"]["formats"]).values()))
    except (OSError, ValueError, KeyError):
        return f"auto: {dense} (the engine has no quantized blocks)"
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        return f"auto: {dense} (no C compiler for the block kernels)"
    acts = settings.decode_activations
    if acts == "auto" and (flags := _cpu_flags()) is not None:  # as engine/model.py chooses
        acts = "auto: " + ("bfloat16" if "avx512_bf16" in flags else "float32")  # (qbf16.c)
    return (
        f"auto: the checkpoint's own {'+'.join(formats)} blocks, {acts} activations "
        "(DISAGG_WEIGHTS=float32: dense; DISAGG_DECODE_ACTIVATIONS=float32, int8 or, on "
        "AVX512-BF16 CPUs, bfloat16: others)"
    )


def print_banner(settings: ServeSettings, gateway: GatewayProcess, e: Endpoints) -> None:
    mode, why = settings.resolved_mode()
    why = "" if why == "set" else f" ({why}; DISAGG_MODE= sets another)"
    threads, nice = prefill_yield(settings)
    yields = (  # only where prefill_yield chose them: what was set is the user's own
        f"\n  prefill  {threads} torch thread at nice {nice} while decode steps, every core "
        "while it idles: yields decode's cores (DISAGG_PREFILL_TORCH_THREADS / "
        "DISAGG_PREFILL_NICE set others)"
        if (threads, nice) != (settings.prefill_torch_threads, settings.prefill_nice)
        else ""
    )
    print(f"""
disagg is serving {settings.engine_dir} ({settings.prefill_instances} prefill,
{settings.decode_instances} decode instance(s); weights {_weights(settings)})
  mode     {mode}{why}{yields}
  OpenAI   {gateway.url}/v1   (chat/completions, completions, models)
  HTTP     {e.http}   (KServe v2, /v2/models/ensemble/generate, generate_stream)
  gRPC     {e.grpc}
  metrics  {e.metrics}

Try:
  curl -s {gateway.url}/v1/chat/completions -H "Authorization: Bearer $DISAGG_API_KEY" \\
    -H 'Content-Type: application/json' -d '{{"model": "{settings.served_model_name}",
    "messages": [{{"role": "user", "content": "Tell me a joke."}}], "max_tokens": 64}}'
  curl -s -X POST {e.http}/v2/models/ensemble/generate -d '{{"text_input":
    "What is the capital of France?", "apply_chat_template": true, "max_tokens": 32,
    "exclude_input_in_output": true}}'
  curl -sN -X POST {e.http}/v2/models/ensemble/generate_stream -d '{{"text_input":
    "Tell me a joke.", "apply_chat_template": true, "max_tokens": 64, "stream": true}}'
  .venv/bin/python client/disagg_client.py --chat "Tell me a joke."
""")


def _serve_banner_extras(
    settings: ServeSettings, server: TritonServer, api_key: str | None
) -> None:
    if api_key:
        print(
            f"API key for the gateway (shown once; only its hash is kept, in "
            f"{settings.keys_file}):\n  export DISAGG_API_KEY={api_key}\n"
        )
    if server.admin_key_generated:
        print(
            f"Admin APIs (model repository, shared memory, logging, trace) need header "
            f"'{ADMIN_HEADER}: {server.admin_key}'\n(set {ADMIN_KEY_ENV} to choose the key; "
            "it is not stored anywhere)."
        )
    print("Ctrl-C to stop.", flush=True)


def _exited(proc: subprocess.Popen[bytes] | None) -> bool:
    assert proc is not None, "started before supervise"
    return proc.poll() is not None


def supervise(settings: ServeSettings, server: TritonServer, gateway: GatewayProcess) -> int:
    """Until Ctrl-C or SIGTERM: restart a gateway that exited, and tritonserver if it died."""
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    crashes: list[float] = []
    Hold.in_dir(settings.path("build_dir")).end()  # one a crash of ours left
    recycler = recycle.Recycler.for_settings(settings)
    assert server.proc is not None, "started"
    recycler.settle(server.proc.pid)
    while not stopping:
        if settings.gateway_enabled and _exited(gateway.proc):  # stateless: restart
            print(f"gateway exited; restarting. Log:\n{gateway.log_tail()}", file=sys.stderr)
            gateway.stop()
            gateway.start()
        if _exited(server.proc):
            crashes = [t for t in crashes if time.monotonic() - t < 3600] + [time.monotonic()]
            if not restart_triton(server, len(crashes)):
                gateway.stop()
                return 1
            assert server.proc is not None, "restarted"
            recycler.settle(server.proc.pid)
        elif server.proc is not None and (why := recycler.check(server.proc.pid)):
            if not recycle_triton(settings, server, gateway, why, lambda: stopping):
                gateway.stop()
                return 1
            assert server.proc is not None, "restarted"
            recycler.settle(server.proc.pid)
        time.sleep(0.5)
    print("\nstopping ...", flush=True)
    if settings.gateway_enabled:
        gateway.stop()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
