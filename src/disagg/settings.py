"""Serving settings: one source for every model config and the tritonserver command line.

Defaults below, overridden by an optional TOML file, then by environment variables named
DISAGG_<SETTING> (e.g. DISAGG_PREFILL_INSTANCES=2). Secrets are never settings: the admin key
comes from DISAGG_ADMIN_KEY only.

Settings come in groups (GROUPS: server, pools, tensorrt_llm, cluster, gateway, paths); a TOML
file may set them at top level or in a table named by their group (`[pools]`). Names stay flat
and unique, so a setting has one name everywhere: here, in DISAGG_<SETTING>, and as the
parameter of each model's config.pbtxt that carries it, which `ModelParams` parses with the
same rules into the same type.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from disagg import prefill_yield
from disagg.contracts import CONDITIONAL, DISAGGREGATED, MODES
from disagg.engine.config import ACTIVATION_SETTINGS
from disagg.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("all", "frontend", "prefill", "decode")
ENV_PREFIX = "DISAGG_"


@dataclass(frozen=True)
class ServeSettings:
    # ---------------------------------------------------------------- server
    host: str = "127.0.0.1"  # every port binds here; loopback unless you mean otherwise
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    triton_server: str = ""  # a tritonserver binary (e.g. NVIDIA's image); "" = nvidia-pytriton's
    triton_backends: str = ""  # its --backend-directory, with triton_server
    # a dead stub's model not READY again this long after its reload: tritonserver restarted
    recover_timeout_s: float = 60.0
    stub_frozen_s: float = 20.0  # a stub running no Python this long: same restart (0: off)
    # once this many stubs died since tritonserver started, or with any dead its threads grew
    # by this share, it is replaced losing no gateway request (serve/recycle.py); 0: off
    recycle_after_faults: int = 3
    recycle_thread_growth: float = 0.5
    recycle_drain_s: float = 120.0
    startup_timeout_s: float = 0.0  # serve's wait for READY (0: by engine, startup_budget_s)
    # on SIGTERM, in-flight requests get this long to finish (new ones refused at once)
    drain_s: float = 10.0
    log_verbose: int = 0
    # the CPU cores tritonserver and every model process of it run on ("0", "2-3", "0,2");
    # "" = all: how `disagg bench cluster` gives each node of a topology its own core
    cpus: str = ""
    # ---------------------------------------------------------------- pools
    # "disaggregated": every prompt through the prefill pool; "colocated": decode prefills its
    # own requests (in chunks beside its batch); "conditional": the orchestrator's cost model
    # picks per request; "auto": conditional where the pools would share this machine's
    # cores, disaggregated where prefill has hardware of its own (see `resolved_mode`)
    mode: str = "auto"
    # conditional mode: the share of a remote prefill's time that still slows decode (0: GPUs)
    conditional_remote_stall: float = 0.5
    prefill_instances: int = 1  # prefill pool size (processes)
    decode_instances: int = 1  # decode pool size (processes, one engine each)
    tokenizer_instances: int = 1
    decode_max_num_seqs: int = 16  # continuous batch size of one decode instance
    # prompt tokens a decode instance prefills itself per step (co-located, fallback,
    # migration), beside its running batch; a longer prompt takes several steps; while more
    # prompts wait than sequences decode, up to decode_burst_tokens a step (lower: earlier
    # first tokens, slower running streams; docs/benchmarks.md)
    decode_prefill_chunk: int = 64  # benchmarks/itl_bench.py: p99 ITL <= 2x p50 under long prompts
    decode_burst_tokens: int = 2048
    # under load (over half of decode_max_num_seqs running) each response carries this many
    # tokens, sent every this many steps; otherwise every token goes out as it is made
    decode_stream_interval: int = 4  # 2 -> 4: chat loop served 1.14x (docs/benchmarks.md)
    max_model_len: int = 2048  # prompt + output tokens
    # prefix cache of each prefill and decode instance, in tokens (46 KB each in fp32 here):
    # K/V of earlier prompts and replies reused by later prompts that start the same way;
    # 0 turns it off (engine/prefix_cache.py, docs/benchmarks.md "Prefix caching")
    prefix_cache_tokens: int = 16384
    max_tokens_limit: int = 1024  # largest max_tokens a request may ask for
    max_tokens_default: int = 128  # when a request does not say
    max_batch_size: int = 8  # Triton batch dimension of client-facing models (requests are 1)
    # matmul precision: "auto" is bfloat16 where the CPU (GPU) multiplies bf16 natively, else
    # float32; bf16 replies differ from fp32 ones after some tokens (docs/benchmarks.md)
    compute_dtype: str = "auto"
    # what the matmuls read: "auto" is the checkpoint's own quantized blocks (GGUF Q4_0/Q4_1/
    # Q8_0) where their CPU kernels build (engine/quant.py: a C compiler), else dense weights
    # at compute_dtype; "float32" / "bfloat16": dense at that precision (compute_dtype unused)
    weights: str = "auto"
    # what decode's block products multiply, and the prefill pool's (a handed-off prompt's
    # K/V computed as decode computes its own): "auto" is bfloat16 where the CPU has
    # AVX512-BF16, else float32; "float32": the fp32 engine's results up to summation order;
    # "int8": rows quantized per 32 values as llama.cpp does (perplexity +0.4%, some greedy
    # replies part at near ties: docs/benchmarks.md); "bfloat16": rows and weights rounded
    # to bf16, products summed in fp32 (engine/qbf16.c; AVX512-BF16 only; perplexity +0.1%;
    # 1.3-1.5x the served throughput), prompts at every length. Quantized weights only.
    decode_activations: str = "auto"
    # where disagg's engine (engine_backend pytorch) runs: "cpu", or "cuda" / "cuda:N"
    device: str = "cpu"
    # the engine of the prefill and decode pools: "pytorch" (disagg's, CPU) or "tensorrt_llm"
    # (NVIDIA GPUs; see docs/gpu.md and build_engines/build_trtllm_engine.py)
    engine_backend: str = "pytorch"
    prefill_torch_threads: int = 0  # 0: torch's default; both 0: prefill_yield.py decides
    prefill_nice: int = 0  # prefill processes' niceness 0-19: yield shared cores to decode
    decode_torch_threads: int = 0
    prefill_timeout_s: float = 60.0  # then the request falls back to decode's own prefill
    # a request whose decode failed waits this long for a decode to take it again (another
    # instance, the restarted one, a replica), then fails; 0: at once (docs/reliability.md)
    decode_recover_s: float = 30.0
    # a decode (replica on another server, or instance in this one) that sent a stream's tokens
    # and then nothing for this long is taken for hung (a frozen or partitioned node, which a
    # dead one is not: no error ever comes) and the stream moves on (remote/pools.py, bls.py)
    decode_hang_s: float = 30.0
    orchestrator_max_concurrency: int = 64  # requests the orchestrator (and router) serve at once
    served_model_name: str = "smollm2-135m-instruct"  # the public name routing rules match
    # ---------------------------------------------------------------- tensorrt_llm
    trtllm_prefill_model: str = ""  # the Hugging Face checkpoint TensorRT-LLM loads
    trtllm_decode_model: str = ""  # ... for the decode pool (the same one)
    trtllm_prefill_options: str = ""  # LLM-API options (YAML) of the prefill pool
    trtllm_decode_options: str = ""  # ... and of the decode pool
    # the GPUs each pool's process may use (its CUDA_VISIBLE_DEVICES), e.g. "0" and "1", or
    # "0,1" for tensor parallel 2; "" = whatever the server was started with
    trtllm_prefill_devices: str = ""
    trtllm_decode_devices: str = ""
    # ---------------------------------------------------------------- cluster
    # what this server runs: "all" (the whole pipeline), "frontend" (tokenizer, router,
    # orchestrator, ensembles, gateway, and any pool not given as replicas below), "prefill"
    # or "decode" (that pool alone, for frontends elsewhere); docs/scale-out.md
    role: str = "all"
    # a pool on other servers: their Triton gRPC addresses "host:port,host:port", or
    # "dns:<name>:<port>" (every address the name resolves to, re-resolved every few
    # seconds); "" = the pool runs in this server
    prefill_replicas: str = ""
    decode_replicas: str = ""
    # times a request is continued by another decode (replica, instance, or the restarted
    # one) when its own fails mid-stream
    migration_limit: int = 2
    kv_port: int = 0  # where a prefill server serves KV payloads (0: any free port)
    kv_advertise_port: int = 0  # the port decode pulls at, behind a port forward (0: kv_port)
    kv_lease_s: float = 30.0  # a payload no decode server pulled is freed after this
    kv_lease_mb: int = 2048  # payload bytes one prefill process holds for pulling, at most
    advertise_host: str = ""  # the address other servers reach this one at ("": host)
    # where a prefill or decode server publishes its prefix cache's KV events (blocks stored
    # and evicted: kvevents.py) to the frontends routing to it, instance i of the pool on
    # this port + i; 0: none (frontends then go by their own record of what they sent where)
    kv_events_port: int = 0
    # how a frontend picks a replica of a remote pool: "cache_aware" (by the prompt blocks
    # each holds and its load: remote/cache_route.py) or "load" (by load alone)
    replica_choice: str = "cache_aware"
    replica_load_weight: float = 0.5  # cache_route.py's w: a block queued vs a block to compute
    # a decode replica with sequences waiting, or its slots or KV this full, is overloaded:
    # its cache is not counted (conversations leave it)
    replica_overload: float = 0.9
    # ---------------------------------------------------------------- gateway
    gateway_port: int = 9000  # the OpenAI-compatible API (binds `host` too)
    gateway_enabled: bool = True  # serve starts the gateway (compose runs it as its own service)
    gateway_triton_url: str = ""  # Triton's gRPC address for the gateway; "" = host:grpc_port
    gateway_auth: bool = True  # API keys required; off is refused on a non-loopback host
    gateway_rpm: int = 600  # requests per minute per key (0: no limit)
    gateway_tpm: int = 1_000_000  # prompt + completion tokens per minute per key (0: no limit)
    gateway_max_body_bytes: int = 1 << 20
    gateway_timeout_s: float = 600.0  # one request, end to end
    # ---------------------------------------------------------------- paths
    # (a relative path is relative to the checkout)
    engine_dir: str = "engines/smollm2-135m-instruct"
    router_policy: str = "model_repository/router/policy.toml"  # reloaded when it changes
    gateway_models: str = "configs/models.toml"  # public names -> versions -> Triton models
    gateway_keys_file: str = ""  # sha256:<hex> lines; "" = <build_dir>/gateway_keys
    build_dir: str = ".triton"  # rendered repositories, backend links, run files, logs

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float") and (isinstance(value, bool) or value < 0):
                raise ConfigError(f"setting {f.name} must be >= 0, got {value!r}")
        for name in (
            "prefill_instances",
            "decode_instances",
            "tokenizer_instances",
            "decode_max_num_seqs",
            "decode_stream_interval",
            "max_batch_size",
            "orchestrator_max_concurrency",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"setting {name} must be >= 1")
        for name, allowed in (
            ("compute_dtype", ("auto", "float32", "bfloat16")),
            ("weights", ("auto", "float32", "bfloat16")),
            ("decode_activations", ACTIVATION_SETTINGS),
            ("engine_backend", ("pytorch", "tensorrt_llm")),
            ("replica_choice", ("cache_aware", "load")),
        ):
            if (value := getattr(self, name)) not in allowed:
                *head, last = allowed
                raise ConfigError(
                    f"setting {name} must be {', '.join(head)} or {last}, got {value!r}"
                )
        parse_cpus(self.cpus)
        if self.role not in ROLES:
            raise ConfigError(f"setting role must be one of {ROLES}, got {self.role!r}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"setting device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.engine_backend == "tensorrt_llm" and (
            self.prefill_instances != 1 or self.decode_instances != 1
        ):
            raise ConfigError(
                "with engine_backend tensorrt_llm each pool is one process (TensorRT-LLM batches "
                "and parallelises inside it): set prefill_instances and decode_instances to 1 "
                "and run more replicas as more servers"
            )
        if self.conditional_remote_stall > 1 or not 0 <= self.prefill_nice <= 19:
            raise ConfigError("need conditional_remote_stall in 0..1 and prefill_nice in 0..19")
        if self.mode not in ("auto", *MODES):
            raise ConfigError(f"setting mode must be auto or one of {MODES}, got {self.mode!r}")
        if not 1 <= self.max_tokens_default <= self.max_tokens_limit < self.max_model_len:
            raise ConfigError("need 1 <= max_tokens_default <= max_tokens_limit < max_model_len")
        try:
            ipaddress.ip_address(self.host)
        except ValueError as e:
            raise ConfigError(f"setting host must be an IP address, got {self.host!r}") from e
        if not self.gateway_auth and not self.is_loopback:
            raise ConfigError(
                f"refusing to serve the gateway on {self.host} with gateway_auth off: "
                "anyone who can reach it could use it"
            )

    def resolved_mode(self) -> tuple[str, str]:
        """The mode the orchestrator runs, and why. "auto" is disaggregated only where prefill
        does not take decode's cores: prefill replicas on other servers, or TensorRT-LLM pools
        on GPUs of their own. Where the pools share cores (one CPU machine, one GPU) every
        remote prefill still stalls decode and costs a KV hand-off, co-located decode pays
        for long prompts in slower steps, and the cost model choosing per request served best
        over the mode comparison's workloads (docs/benchmarks.md): conditional."""
        if self.mode != "auto":
            return self.mode, "set"
        if self.prefill_replicas:
            return DISAGGREGATED, "prefill runs on its own servers"
        pre, dec = (
            {d.strip() for d in getattr(self, f"trtllm_{p}_devices").split(",")} - {""}
            for p in ("prefill", "decode")
        )
        if self.engine_backend == "tensorrt_llm" and pre and dec and not pre & dec:
            return DISAGGREGATED, "prefill and decode have GPUs of their own"
        return CONDITIONAL, "prefill and decode would share this machine's cores"

    @property
    def startup_budget_s(self) -> float:
        """serve's wait for READY (a startupProbe must wait as long). TensorRT-LLM pools load,
        warm up, capture CUDA graphs: upstream's disaggregated tests give them 1200 s."""
        remote = self.role == "frontend" and self.prefill_replicas and self.decode_replicas
        trtllm = self.engine_backend == "tensorrt_llm" and not remote
        return self.startup_timeout_s or (1200.0 if trtllm else 180.0)

    @property
    def kv_pull(self) -> bool:
        """Whether this server's prefill leases its payloads for decode servers to pull
        (kvnet.py) rather than returning the bytes: decode runs elsewhere."""
        return self.role == "prefill" or bool(self.decode_replicas)

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback

    @property
    def keys_file(self) -> Path:
        return (
            self.path("gateway_keys_file")
            if self.gateway_keys_file
            else (self.path("build_dir") / "gateway_keys")
        )

    def path(self, name: str) -> Path:
        """A path setting as an absolute path (model processes run elsewhere)."""
        p = Path(getattr(self, name))
        return p if p.is_absolute() else (ROOT / p)

    @classmethod
    def load(
        cls, toml_path: str | Path | None = None, env: Mapping[str, str] | None = None
    ) -> ServeSettings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}  # name -> value, of that setting's type once coerced
        if toml_path:
            try:
                values.update(_flatten_groups(tomllib.loads(Path(toml_path).read_text())))
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ConfigError(f"settings file {toml_path}: {e}") from e
        known = {f.name: f for f in fields(cls)}
        unknown = set(values) - set(known)
        if unknown:
            raise ConfigError(f"unknown settings: {sorted(unknown)}")
        for name, _f in known.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = raw
        for name, value in list(values.items()):
            values[name] = coerce_setting(name, str(known[name].type), value)
        return replace(cls(), **values)


def parse_cpus(text: str) -> set[int]:
    """ "0,2-3" -> {0, 2, 3}; "" -> set() (no pinning)."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ConfigError(f"setting cpus: core numbers like 0, 0-1 or 0,2; got {text!r}")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


_GROUP_STARTS = {
    "host": "server",
    "mode": "pools",
    "trtllm_prefill_model": "tensorrt_llm",
    "role": "cluster",
    "gateway_port": "gateway",
    "engine_dir": "paths",
}


def _groups() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    group = ""
    for f in fields(ServeSettings):
        group = _GROUP_STARTS.get(f.name, group)
        out.setdefault(group, []).append(f.name)
    return {g: tuple(names) for g, names in out.items()}


GROUPS = _groups()


def _flatten_groups(values: dict[str, object]) -> dict[str, object]:
    """TOML tables named by a group hold that group's settings."""
    flat: dict[str, object] = {}
    for key, value in values.items():
        if isinstance(value, dict) and key in GROUPS:
            stray = sorted(set(value) - set(GROUPS[key]))
            if stray:
                raise ConfigError(f"settings {stray} are not in group [{key}]")
            flat.update(value)
        else:
            flat[key] = value
    return flat


def coerce_setting(name: str, type_name: str, value: object) -> Setting:
    if type_name == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"setting {name}: expected true or false, got {value!r}")
    try:
        if type_name == "str":
            return str(value)
        if not isinstance(value, str | int | float):  # e.g. a TOML list
            raise TypeError(type(value).__name__)
        if type_name == "int":
            if isinstance(value, bool):
                raise ValueError("a boolean")
            return int(value)
        if type_name == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"setting {name}: expected {type_name}, got {value!r}") from e


def template_values(s: ServeSettings, run_dir: Path) -> dict[str, str]:
    """What the ${...} keys of the config.pbtxt templates are filled with."""
    values = {f.name: str(getattr(s, f.name)) for f in fields(s)}
    values["engine_dir"] = str(s.path("engine_dir"))
    values["router_policy"] = str(s.path("router_policy"))
    # model processes do not run in the checkout: relative paths resolve against it here
    for pool in ("prefill", "decode"):
        options, model = f"trtllm_{pool}_options", f"trtllm_{pool}_model"
        if getattr(s, options):
            values[options] = str(s.path(options))
        if getattr(s, model) and s.path(model).exists():  # else a Hugging Face hub name
            values[model] = str(s.path(model))
    values["run_dir"] = str(run_dir)
    values["kv_pull"] = str(s.kv_pull).lower()
    values["mode"] = s.resolved_mode()[0]
    values.update(prefill_yield.template_values(s))
    return values


SETTING_TYPES = {f.name: str(f.type) for f in fields(ServeSettings)}
Setting = str | int | float | bool  # a setting's value, of the type its field names
