"""What each Triton model reads from its config.pbtxt, typed: one frozen dataclass per model,
each field named as the parameter (and the setting it comes from) and of that setting's type.
A model's initialize fills its dataclass at once with `ModelParams.typed`, so a parameter its
config lacks fails the load, not the first request that would have read it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

from disagg.engine.config import EngineConfig
from disagg.errors import ConfigError
from disagg.settings import SETTING_TYPES, Setting, coerce_setting

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass(frozen=True)
class TokenizerParams:
    engine_dir: str


@dataclass(frozen=True)
class TrtllmPrefillParams:
    """What TensorRT-LLM's prefill engine is built from (trtllm/runtime.py)."""

    trtllm_prefill_model: str
    trtllm_prefill_options: str
    trtllm_prefill_devices: str
    max_model_len: int
    kv_lease_s: float  # also how long a context may wait for its generation half


@dataclass(frozen=True)
class PrefillParams(TrtllmPrefillParams):
    engine_backend: str
    engine_dir: str
    compute_dtype: str
    weights: str
    # as decode's (the setting): a handed-off prompt's K/V computed as decode computes its own
    decode_activations: str
    device: str
    max_tokens_limit: int
    prefill_torch_threads: int
    prefill_nice: int  # this process's CPU niceness (0: as started)
    cores_shared: bool  # holds engine/cpu_share.py's lock while it computes
    # payloads leased for decode servers elsewhere to pull (triton/pools.py KVLeaseServer)
    kv_pull: bool
    host: str
    advertise_host: str
    kv_port: int
    kv_advertise_port: int
    kv_events_port: int  # its prefix cache's events for frontends (kvevents.py); 0: none
    kv_lease_mb: int
    prefix_cache_tokens: int
    run_dir: str  # the cancel registry (cancel.py): a prefill stops when its request is marked

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            max_model_len=self.max_model_len,
            max_tokens_limit=self.max_tokens_limit,
            prefix_cache_tokens=self.prefix_cache_tokens,
        )


@dataclass(frozen=True)
class TrtllmDecodeParams:
    """What TensorRT-LLM's decode engine is built from (trtllm/runtime.py)."""

    trtllm_decode_model: str
    trtllm_decode_options: str
    trtllm_decode_devices: str
    max_model_len: int
    decode_max_num_seqs: int


@dataclass(frozen=True)
class DecodeParams(TrtllmDecodeParams):
    engine_backend: str
    engine_dir: str
    compute_dtype: str
    weights: str
    decode_activations: str
    device: str
    max_tokens_limit: int
    decode_prefill_chunk: int
    decode_burst_tokens: int
    decode_stream_interval: int
    decode_torch_threads: int
    decode_one_pool: bool
    cores_shared: bool  # a prefill pool computes on its cores (engine/cpu_share.py)
    run_dir: str
    prefix_cache_tokens: int
    host: str  # where its KV events are published (kv_events_port; 0: none)
    kv_events_port: int

    def engine_config(self) -> EngineConfig:
        """Decode's KV cache is touched at start: steady-state speed from the first request."""
        return EngineConfig(
            max_model_len=self.max_model_len,
            max_tokens_limit=self.max_tokens_limit,
            max_num_seqs=self.decode_max_num_seqs,
            prefault_kv=True,
            prefill_chunk_tokens=self.decode_prefill_chunk,
            burst_prefill_tokens=self.decode_burst_tokens,
            prefix_cache_tokens=self.prefix_cache_tokens,
        )


@dataclass(frozen=True)
class OrchestratorParams:
    engine_dir: str
    max_model_len: int
    max_tokens_limit: int
    max_tokens_default: int
    run_dir: str
    prefill_model: str  # the pools' model names in this server
    decode_model: str
    prefill_replicas: str  # or the pools on other servers
    decode_replicas: str
    replica_choice: str  # how their replicas are chosen (remote/cache_route.py)
    replica_load_weight: float
    replica_overload: float
    prefill_timeout_s: float
    mode: str
    conditional_remote_stall: float
    prefill_instances: int
    orchestrator_max_concurrency: int
    migration_limit: int
    decode_recover_s: float
    decode_hang_s: float
    prefix_cache_tokens: int  # the pools' own budget: how much of them the locality mirrors
    decode_instances: int  # more than one: which instance holds a prompt is not known here

    def engine_config(self) -> EngineConfig:
        """Limits only: the orchestrator checks requests against them, it runs no engine."""
        return EngineConfig(
            max_model_len=self.max_model_len, max_tokens_limit=self.max_tokens_limit
        )


@dataclass(frozen=True)
class RouterParams:
    engine_dir: str
    router_policy: str
    served_model_name: str
    max_tokens_default: int
    run_dir: str
    orchestrator_max_concurrency: int


# ------------------------------------------------------------------ inside the models
# Parameters a model's config.pbtxt carries besides settings (filled by `disagg serve`).
MODEL_ONLY_PARAMETERS = {
    "run_dir": "str",
    "prefill_model": "str",
    "decode_model": "str",
    "kv_pull": "bool",  # ServeSettings.kv_pull
    "decode_one_pool": "bool",  # prefill_yield.decode_one_pool
    "cores_shared": "bool",  # prefill_yield.shares_cores
}
Params = TypeVar("Params", bound="DataclassInstance")


class ModelParams:
    """A model's config.pbtxt parameters, typed: each is named as the setting it comes from
    and parsed by the same rules (`coerce_setting`) into the same type. A parameter that names no
    setting fails the model's load; asking for one the config lacks fails loudly too."""

    def __init__(self, raw: dict[str, str], model: str = "model") -> None:
        types = {**SETTING_TYPES, **MODEL_ONLY_PARAMETERS}
        unknown = sorted(set(raw) - set(types))
        if unknown:
            raise ConfigError(f"{model}: config.pbtxt parameters {unknown} name no setting")
        self._model = model
        self._values = {k: coerce_setting(k, types[k], v) for k, v in raw.items()}

    def __getattr__(self, name: str) -> Setting:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise ConfigError(
                f"{self._model}: its config.pbtxt has no parameter {name!r}"
            ) from None

    def get(self, name: str, default: Setting | None = None) -> Setting | None:
        return self._values.get(name, default)

    def typed(self, cls: type[Params]) -> Params:
        """`cls` (a model's dataclass in model_params.py) filled with the parameters its
        fields name: read at once in initialize, so one the config lacks fails the load."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})
