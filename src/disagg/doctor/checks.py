"""The doctor's checks: each takes the settings and the System and returns one Result."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from disagg.doctor.system import System
from disagg.settings import ServeSettings

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
MODELS = ("router", "orchestrator", "tokenizer", "prefill", "decode", "ensemble")
STUB_SHM_BYTES = 64 * 2**20  # what disagg serve gives each stub (serve/server.py)
SLOW_TTFT_S = 5.0

# the symptoms no single check can see, and where to look (the article's table, our names)
WHERE_TO_LOOK = (
    (
        "first request very slow",
        "weights loading, engine warm-up: the server log (DISAGG_LOG_VERBOSE=1); send a "
        "warm-up request before taking traffic (disagg serve waits for READY)",
    ),
    (
        "TTFT high, GPU/CPU use uneven",
        "prefill and decode contending: `disagg status` (prefill queue, decode batch) and "
        "disagg_queue_seconds{pool=...}; on one machine try DISAGG_MODE=colocated or "
        "conditional, or limit long prompts (max_model_len)",
    ),
    (
        "decode out of memory",
        "KV cache too large for the decode pool: lower max_tokens_limit or "
        "decode_max_num_seqs, give decode more GPUs, or turn on KV offload "
        "(build_trtllm_engine.py --decode-host-cache-gb)",
    ),
    (
        "requests time out / 502",
        "the server log and the load balancer's; disagg_errors_total{kind=...}; a pool at its "
        "limit (scale it) or the network between pools ("
        "disagg_kv_handoff_seconds)",
    ),
)


@dataclass(frozen=True)
class Result:
    name: str
    status: str
    detail: str
    fix: str = ""


def wants_gpu(s: ServeSettings) -> bool:
    return s.engine_backend == "tensorrt_llm" or s.device.startswith("cuda")


def check_driver(s: ServeSettings, sys_: System) -> Result:
    name = "NVIDIA driver"
    if not sys_.which("nvidia-smi"):
        if wants_gpu(s):
            return Result(name, FAIL, "nvidia-smi not found", "install the NVIDIA driver")
        return Result(name, SKIP, "a CPU deployment (no nvidia-smi either)")
    rc, out = sys_.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if rc != 0:
        return Result(
            name,
            FAIL if wants_gpu(s) else WARN,
            f"nvidia-smi failed: {out.splitlines()[0] if out else rc}",
            "the driver does not match the kernel or is not loaded: `dmesg | grep -i nvidia`, "
            "`lsmod | grep nvidia`; reinstall a matching driver (test it off the serving host)",
        )
    return Result(name, OK, f"driver {out.splitlines()[0]}")


def check_container_toolkit(s: ServeSettings, sys_: System) -> Result:
    name = "Docker GPU access"
    if not wants_gpu(s) or not sys_.which("docker"):
        return Result(name, SKIP, "no GPU deployment, or no docker here")
    rc, out = sys_.run(["docker", "info", "--format", "{{json .Runtimes}}"])
    if rc != 0:
        return Result(name, SKIP, "no Docker engine reachable from here")
    if "nvidia" in out:
        return Result(name, OK, "Docker has the nvidia runtime")
    if sys_.which("nvidia-container-cli") and sys_.run(["nvidia-container-cli", "info"])[0] == 0:
        return Result(name, OK, "NVIDIA Container Toolkit present (CDI)")
    return Result(
        name,
        FAIL,
        "Docker has no nvidia runtime ('could not select device driver with capabilities: gpu')",
        "install the NVIDIA Container Toolkit, `nvidia-ctk runtime configure --runtime=docker`, "
        "restart Docker",
    )


def _build_record(s: ServeSettings) -> dict[str, Any]:
    if not s.trtllm_decode_options:
        return {}
    path = s.path("trtllm_decode_options").parent / "build.json"
    try:
        record: dict[str, Any] = json.loads(path.read_text())
        return record
    except (OSError, ValueError):
        return {}


def check_tensorrt_llm(s: ServeSettings, sys_: System) -> Result:
    name = "TensorRT-LLM"
    if s.engine_backend != "tensorrt_llm":
        return Result(name, SKIP, "engine_backend is pytorch")
    found = sys_.tensorrt_llm()
    if found is None:
        return Result(
            name,
            FAIL,
            "`import tensorrt_llm` fails here",
            "run in NVIDIA's -trtllm-python-py3 image; if it is installed, run "
            "`python3 -c 'import tensorrt_llm'` for the error (a tokenizers/transformers "
            "version clash: deploy/image_requirements.py)",
        )
    version, fields = found
    if tuple(int(x) for x in version.split(".")[:1] if x.isdigit()) < (1,):
        return Result(name, FAIL, f"TensorRT-LLM {version}", "disagg needs 1.0 or later")
    from disagg.trtllm.runtime import read_options

    unknown = set()
    for pool in ("prefill", "decode"):
        unknown |= set(read_options(str(s.path(f"trtllm_{pool}_options")))) - fields
    if unknown:
        return Result(
            name,
            FAIL,
            f"TensorRT-LLM {version} does not take options {sorted(unknown)}",
            "rebuild the options with this image's build_engines/build_trtllm_engine.py",
        )
    built = _build_record(s).get("tensorrt_llm")
    if built and built.split(".")[:2] != version.split(".")[:2]:
        return Result(
            name,
            WARN,
            f"options built against TensorRT-LLM {built}, this image has {version}",
            "rebuild with build_engines/build_trtllm_engine.py in this image",
        )
    return Result(name, OK, f"TensorRT-LLM {version}; every option is known")


def check_gpu_memory(s: ServeSettings, sys_: System) -> Result:
    name = "GPU memory"
    if s.engine_backend != "tensorrt_llm":
        return Result(name, SKIP, "engine_backend is pytorch")
    from disagg.trtllm.runtime import read_options

    rc, out = sys_.run(
        [
            "nvidia-smi",
            "--query-gpu=index,memory.total,memory.used",
            "--format=csv,noheader,nounits",
        ]
    )
    if rc != 0:
        return Result(name, SKIP, "nvidia-smi gives no memory figures (see the driver check)")
    gpus = {}
    for line in out.splitlines():
        index, total, used = (int(x.strip()) for x in line.split(","))
        gpus[index] = (total, used)
    share: dict[int, float] = {}
    for pool in ("prefill", "decode"):
        options = read_options(str(s.path(f"trtllm_{pool}_options")))
        fraction = float(options.get("kv_cache_config", {}).get("free_gpu_memory_fraction", 0.9))
        devices = getattr(s, f"trtllm_{pool}_devices") or ",".join(map(str, sorted(gpus)))
        for d in (int(x) for x in devices.split(",")):
            if d not in gpus:
                return Result(
                    name, FAIL, f"the {pool} pool names GPU {d}; this machine has {sorted(gpus)}",
                    f"set trtllm_{pool}_devices to GPUs that exist",
                )  # fmt: skip
            share[d] = share.get(d, 0.0) + fraction
    over = {d: f for d, f in share.items() if f >= 0.95}
    if over:
        return Result(
            name,
            FAIL,
            f"KV cache fractions on GPU {sorted(over)} add up to {max(over.values()):.2f}",
            "pools sharing a GPU must sum under 0.95 (rebuild with --decode-devices; the build "
            "picks 0.3 + 0.55)",
        )
    busy = {d: used for d, (total, used) in gpus.items() if d in share and used > 0.1 * total}
    if busy:
        return Result(
            name,
            WARN,
            f"other processes hold memory on GPU {sorted(busy)} (MiB: {busy})",
            "the KV fractions are of free memory: the pools get less; free those GPUs",
        )
    return Result(name, OK, f"fractions per GPU {share}")


def check_ports(s: ServeSettings, sys_: System) -> Result:
    name = "ports"
    ports = {"http": s.http_port, "grpc": s.grpc_port, "metrics": s.metrics_port}
    if s.gateway_enabled:
        ports["gateway"] = s.gateway_port
    taken = {k: p for k, p in ports.items() if sys_.port_in_use(s.host, p)}
    if not taken:
        return Result(name, OK, f"free on {s.host}: {ports}")
    if sys_.http_get(f"http://{s.host}:{s.http_port}/v2/health/live") == 200:
        return Result(name, OK, f"in use by a running Triton on {s.host}: {taken}")
    return Result(
        name,
        FAIL,
        f"in use on {s.host} by another process: {taken}",
        "stop it (`ss -ltnp`) or pick other ports: DISAGG_HTTP_PORT, DISAGG_GRPC_PORT, "
        "DISAGG_METRICS_PORT, DISAGG_GATEWAY_PORT",
    )


def check_shm(s: ServeSettings, sys_: System) -> Result:
    name = "/dev/shm"
    free = sys_.shm_free_bytes()
    if free is None:
        return Result(name, FAIL, "/dev/shm is missing", "the Python backend needs /dev/shm")
    stubs = s.prefill_instances + s.decode_instances + s.tokenizer_instances + 4
    need = stubs * STUB_SHM_BYTES * 2  # each region grows by one more step under load
    if free < need:
        return Result(
            name,
            FAIL,
            f"{free >> 20} MiB free, {need >> 20} MiB needed for {stubs} stubs",
            "Docker: --ipc=host or --shm-size=2g; Kubernetes: an emptyDir with medium: Memory "
            "mounted at /dev/shm",
        )
    return Result(name, OK, f"{free >> 20} MiB free ({need >> 20} MiB needed)")


def check_stale_shm(s: ServeSettings, sys_: System) -> Result:
    name = "stale stub memory"
    stale = sys_.stale_stub_regions()
    if not stale:
        return Result(name, OK, "no Python backend region in /dev/shm is left unused")
    held = sum(size for _, size in stale)
    return Result(
        name,
        WARN,
        f"{len(stale)} Python backend regions in /dev/shm, {held >> 20} MiB of RAM, mapped by "
        "no process (stubs leave them when their server is killed with SIGKILL)",
        "disagg doctor --remove-stale-shm (removes only regions no process maps or holds)",
    )


def check_stub_interpreter(s: ServeSettings, sys_: System) -> Result:
    name = "stub interpreter"
    if s.triton_server:
        return Result(name, SKIP, "the image's own tritonserver and stub (triton_server is set)")
    lib = sys_.stub_libpython()
    if lib is None:
        return Result(
            name,
            FAIL,
            f"no Python backend stub for Python {sys.version_info.major}."
            f"{sys.version_info.minor} in nvidia-pytriton, or ldd cannot read it",
            "use Python 3.11: `make venv` (builds .venv from /usr/bin/python3.11)",
        )
    base = os.path.realpath(sys.base_prefix)
    if not os.path.realpath(lib).startswith(base.rstrip("/") + "/"):
        return Result(
            name,
            FAIL,
            f"the stub embeds {lib} but this venv is made from {base} ({sys.version.split()[0]})",
            "models would mix two interpreters (e.g. `_ssl` fails inside them): recreate the "
            "venv with the system interpreter, /usr/bin/python3.11 -m venv .venv",
        )
    return Result(name, OK, f"stub and venv share {lib}")


def check_models(s: ServeSettings, sys_: System) -> Result:
    name = "models ready"
    base = f"http://{s.host}:{s.http_port}"
    if sys_.http_get(base + "/v2/health/live") != 200:
        return Result(name, SKIP, f"no server at {base}: start one (make serve) and rerun")
    down = [m for m in MODELS if sys_.http_get(f"{base}/v2/models/{m}/ready") != 200]
    if down:
        return Result(
            name,
            FAIL,
            f"not ready: {down}",
            "the server log names the failing model's error (.triton/logs, or the container's)",
        )
    return Result(name, OK, f"{len(MODELS)} models ready")


def check_ttft(s: ServeSettings, sys_: System) -> Result:
    name = "warm-up TTFT"
    if sys_.http_get(f"http://{s.host}:{s.http_port}/v2/models/router/ready") != 200:
        return Result(name, SKIP, "no ready server to send a request to")
    try:
        ttft = sys_.ttft_s(s)
    except Exception as e:
        return Result(name, FAIL, f"a warm-up request failed: {e}", WHERE_TO_LOOK[3][1])
    if ttft > SLOW_TTFT_S:
        return Result(name, WARN, f"{ttft:.2f} s to the first token", WHERE_TO_LOOK[1][1])
    return Result(name, OK, f"{ttft * 1000:.0f} ms to the first token")


CHECKS: tuple[Callable[[ServeSettings, System], Result], ...] = (
    check_driver,
    check_container_toolkit,
    check_tensorrt_llm,
    check_gpu_memory,
    check_ports,
    check_shm,
    check_stale_shm,
    check_stub_interpreter,
    check_models,
    check_ttft,
)
