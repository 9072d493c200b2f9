"""What the simulator serves a workload on: the mode, how many replicas of each pool, the
engine limits they run with, and whether they have hardware of their own.

Spelled on the command line as `<mode>:<P>p<D>d[@shared]`, e.g. `disaggregated:2p1d`
(two prefill nodes, one decode node), `colocated:2d` (two decode nodes prefilling their own
requests; `colocated:2` is the same), `conditional:1p1d@shared` (one server whose pools
share its cores, as `make serve` runs them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from disagg.contracts import COLOCATED, CONDITIONAL, DISAGGREGATED, MODES
from disagg.engine.config import EngineConfig
from disagg.errors import ConfigError
from disagg.settings import ServeSettings

LEAST_LOADED, ROUND_ROBIN = "least_loaded", "round_robin"
ROUTERS = (LEAST_LOADED, ROUND_ROBIN)
_SPEC = re.compile(r"^(\w+):(?:(\d+)p)?(\d+)d?(@shared)?$")


@dataclass(frozen=True)
class Topology:
    mode: str  # colocated | disaggregated | conditional (contracts.MODES)
    num_prefill: int = 1  # prefill replicas (0 in colocated mode); each one engine instance
    num_decode: int = 1  # decode replicas, each one DecodeEngine
    # the engine limits: the server's defaults
    max_num_seqs: int = ServeSettings.decode_max_num_seqs
    prefill_chunk: int = ServeSettings.decode_prefill_chunk
    burst_prefill_tokens: int = EngineConfig.burst_prefill_tokens
    max_model_len: int = ServeSettings.max_model_len
    max_queue: int = EngineConfig.max_queue  # waiting sequences before refusals
    stream_interval: int = ServeSettings.decode_stream_interval
    # how the frontend picks a replica: least_loaded is remote/replicas.py ReplicaSet (what
    # the cluster runs), round_robin takes them in turn
    router: str = LEAST_LOADED
    # every pool on one machine's cores (one server): their work slows each other by
    # `contention` (planner/clock.py Node; None: the profile's); else a node per replica, as
    # `bench cluster` runs
    shared: bool = False
    contention: float | None = None
    # the conditional mode's prior for a remote prefill's stall of decode (CostParams); None:
    # 0.5 on shared cores, 0 on separate nodes (as settings and bench/topology.py set it)
    remote_stall: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.num_decode < 1:
            raise ConfigError("a topology needs at least one decode replica")
        if self.mode != COLOCATED and self.num_prefill < 1:
            raise ConfigError(f"{self.mode} needs at least one prefill replica")
        if self.mode == COLOCATED and self.num_prefill:
            object.__setattr__(self, "num_prefill", 0)
        self.engine_config()  # its own checks (chunk >= 16, ...)

    def engine_config(self) -> EngineConfig:
        """What each decode replica's engine runs with (no prefix cache: not simulated)."""
        return EngineConfig(
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            prefill_chunk_tokens=self.prefill_chunk, burst_prefill_tokens=self.burst_prefill_tokens,
            max_queue=self.max_queue, max_tokens_limit=self.max_model_len, prefix_cache_tokens=0,
        )  # fmt: skip

    @property
    def num_nodes(self) -> int:
        """Machines it takes: one when shared, else one per replica."""
        return 1 if self.shared else self.num_prefill + self.num_decode

    @property
    def stall_prior(self) -> float:
        if self.remote_stall is not None:
            return self.remote_stall
        return 0.5 if self.shared else 0.0

    @property
    def name(self) -> str:
        pools = (
            f"{self.num_decode}d"
            if self.mode == COLOCATED
            else f"{self.num_prefill}p{self.num_decode}d"
        )
        return f"{self.mode}:{pools}" + ("@shared" if self.shared else "")

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "name": self.name}

    @classmethod
    def parse(cls, spec: str, **options: Any) -> Topology:
        """`<mode>:<P>p<D>d[@shared]` (see the module docstring); `options` set the rest."""
        m = _SPEC.match(spec.strip())
        if m is None:
            raise ConfigError(
                f"topology {spec!r}: expected <mode>:<P>p<D>d[@shared], e.g. disaggregated:2p1d"
            )
        mode, prefill, decode, shared = m.groups()
        if mode != COLOCATED and prefill is None:
            raise ConfigError(f"topology {spec!r}: {mode} needs <P>p, e.g. {mode}:1p1d")
        options["shared"] = bool(shared) or options.get("shared", False)
        return cls(mode, int(prefill or 0), int(decode), **options)

    @classmethod
    def from_settings(cls, s: ServeSettings, shared: bool = True, **options: Any) -> Topology:
        """The topology one server with these settings runs (`shared`: on one machine's
        cores), its mode resolved as the server resolves it."""
        mode, _ = s.resolved_mode()
        base = cls(
            mode if mode in (COLOCATED, DISAGGREGATED, CONDITIONAL) else CONDITIONAL,
            num_prefill=s.prefill_instances, num_decode=s.decode_instances,
            max_num_seqs=s.decode_max_num_seqs, prefill_chunk=s.decode_prefill_chunk,
            burst_prefill_tokens=s.decode_burst_tokens,
            max_model_len=s.max_model_len, stream_interval=s.decode_stream_interval,
            shared=shared, remote_stall=s.conditional_remote_stall if shared else None,
        )  # fmt: skip
        return replace(base, **options)
