"""The profile file: what serving costs on one kind of machine, as `disagg profile` measured
it, and what the simulator reads. Torch-free.

A profile holds fitted cost models (planner/costs.py) for the work that decides serving:

    prefill     a whole prompt in the prefill pool (PrefillEngine.prefill), by prompt tokens
    chunk       a prompt chunk decode prefills beside its batch (Llama.prefill_chunk)
    decode      one decode step (DecodeEngine.step: model, sampling, bookkeeping)
    mixed_factor  a measured chunk-plus-decode step over the sum of its two parts' costs
    pack        KVPayload.pack of a prompt's K/V, by bytes (the prefill server, before it answers)
    kv_write    a payload into a decode slot (KVCacheSlots.write), by bytes (inside a step)
    handoff     per path ("shm": one server; "network": kvnet over TCP): what is left of the
                hand-off after the first token went out, by bytes
    overheads   per-hop costs of the served path that the profiler cannot measure without a
                server (their `source` says where the numbers come from)

and the raw samples they were fitted from, the machine (CPU model and flags, cores, GPU),
torch version, model, device, dtype and thread count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from disagg.errors import ConfigError
from disagg.planner.costs import (
    ChunkCost,
    DecodeCost,
    Linear,
    PiecewiseLinear,
    fit_chunk,
    fit_decode,
    fit_linear,
    fit_piecewise,
)

FORMAT = "disagg-profile/1"
KV_HEADER_BYTES = 1024  # engine/kv_payload.py HEADER_SPACE: a payload's bytes beyond its K/V
SHM, NETWORK = "shm", "network"  # hand-off paths (as orchestrator.kv_path names them)
Samples = list[list[float]]  # measured points, one list each


@dataclass(frozen=True)
class Overheads:
    """Costs of the served path outside the engine, in seconds."""

    dispatch_s: float = 0.005  # client -> a pool starts the request (router, orchestrator, BLS)
    return_s: float = 0.003  # a response's way from a pool back to the client
    send_s: float = 0.0003  # decode's own time per response it sends (in its step loop)
    # decode's time per step outside the engine's forward (scheduler, Python, the served
    # loop's bookkeeping): what calibration on served runs finds (benchmarks/sim_vs_real.py)
    step_s: float = 0.0
    # how much jobs on one machine's cores slow each other (planner/clock.py Node): 1 is fair
    # sharing; two processes each splitting their work among the same cores lose more (a
    # parallel region waits for a preempted thread: docs/benchmarks.md "Served against the
    # engine"). What a loaded calibration finds (planner/calibrate.py), else 1
    contention: float = 1.0
    source: str = (
        "assumed from docs/benchmarks.md 'Served pipeline' (2026-11-29): served TTFT was 8.1 ms "
        "over the in-process engine's; sending responses was ~9% of the decode loop"
    )

    def to_json(self) -> dict[str, Any]:
        return {"dispatch_s": self.dispatch_s, "return_s": self.return_s,
                "send_s": self.send_s, "step_s": self.step_s, "contention": self.contention,
                "source": self.source}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Overheads:
        return cls(float(d["dispatch_s"]), float(d["return_s"]), float(d["send_s"]),
                   float(d.get("step_s", 0.0)), float(d.get("contention", 1.0)),
                   str(d.get("source", "")))  # fmt: skip


@dataclass(frozen=True)
class Profile:
    prefill: PiecewiseLinear  # prompt tokens -> s
    chunk: ChunkCost
    decode: DecodeCost
    pack: Linear  # bytes -> s
    kv_write: Linear  # bytes -> s
    handoff: dict[str, Linear]  # path -> (bytes -> s)
    kv_bytes_per_token: int  # K and V, every layer (ModelArgs.kv_bytes_per_token)
    mixed_factor: float = 1.0
    overheads: Overheads = field(default_factory=Overheads)
    machine: dict[str, Any] = field(default_factory=dict)  # cpu, flags, cores, gpu, torch
    model: dict[str, Any] = field(default_factory=dict)  # name, fingerprint, architecture
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # torch intra-op threads the engine ran with
    quick: bool = False  # measured with --quick (fewer points, fewer repetitions)
    created: str = ""
    samples: dict[str, Samples] = field(default_factory=dict)

    def payload_bytes(self, num_tokens: int) -> int:
        """Bytes of a KV payload for `num_tokens` prompt tokens (header included)."""
        return num_tokens * self.kv_bytes_per_token + KV_HEADER_BYTES

    def handoff_s(self, path: str, num_tokens: int) -> float:
        if path not in self.handoff:
            raise ConfigError(
                f"the profile has no '{path}' hand-off (it has {sorted(self.handoff)})"
            )
        return self.handoff[path](self.payload_bytes(num_tokens))

    def with_overheads(self, **changes: Any) -> Profile:
        return replace(self, overheads=replace(self.overheads, **changes))

    # ---------------------------------------------------------------- the file

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "created": self.created,
            "machine": self.machine,
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "threads": self.threads,
            "quick": self.quick,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "costs": {
                "prefill": self.prefill.to_json(),
                "chunk": self.chunk.to_json(),
                "decode": self.decode.to_json(),
                "mixed_factor": self.mixed_factor,
                "pack": self.pack.to_json(),
                "kv_write": self.kv_write.to_json(),
                "handoff": {p: c.to_json() for p, c in self.handoff.items()},
            },
            "overheads": self.overheads.to_json(),
            "samples": self.samples,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Profile:
        if d.get("format") != FORMAT:
            raise ConfigError(f"not a disagg profile (format {d.get('format')!r}, want {FORMAT!r})")
        try:
            c = d["costs"]
            return cls(
                prefill=PiecewiseLinear.from_json(c["prefill"]),
                chunk=ChunkCost.from_json(c["chunk"]),
                decode=DecodeCost.from_json(c["decode"]),
                pack=Linear.from_json(c["pack"]),
                kv_write=Linear.from_json(c["kv_write"]),
                handoff={p: Linear.from_json(v) for p, v in c["handoff"].items()},
                kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                mixed_factor=float(c.get("mixed_factor", 1.0)),
                overheads=Overheads.from_json(d["overheads"]),
                machine=dict(d.get("machine", {})),
                model=dict(d.get("model", {})),
                device=str(d.get("device", "cpu")),
                dtype=str(d.get("dtype", "float32")),
                threads=int(d.get("threads", 0)),
                quick=bool(d.get("quick", False)),
                created=str(d.get("created", "")),
                samples={
                    k: [list(map(float, r)) for r in v] for k, v in d.get("samples", {}).items()
                },
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"profile incomplete or malformed: {e!r}") from e

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path} not found: measure one with `disagg profile --out {path}`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not JSON ({e})") from e
        return cls.from_json(data)

    def describe(self) -> str:
        """A few lines: where it was measured, and the costs at typical sizes."""
        m = self.machine
        where = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores"
        if m.get("gpu"):
            where = f"{m['gpu']} ({where})"
        mb = self.payload_bytes(1024) / 1e6
        lines = [
            f"{self.model.get('name', '?')} on {where}; device {self.device}, "
            f"weights {self.model.get('weights', self.dtype)}, "
            f"{self.threads or 'default'} threads; torch {m.get('torch', '?')}"
            + (" (quick)" if self.quick else ""),
            f"prefill 128 / 1024 / 2000 tokens: {self.prefill(128) * 1e3:.1f} / "
            f"{self.prefill(1024) * 1e3:.1f} / {self.prefill(2000) * 1e3:.1f} ms",
            f"chunk of 64 after 0 / 1024: {self.chunk(64, 0) * 1e3:.1f} / "
            f"{self.chunk(64, 1024) * 1e3:.1f} ms",
            "decode step, batch 1 / 8 / 32 at 512 positions: "
            + " / ".join(f"{self.decode(b, 512) * 1e3:.1f}" for b in (1, 8, 32))
            + " ms",
            f"chunk-plus-decode factor {self.mixed_factor:.2f}",
            f"1024-token payload ({mb:.1f} MB): pack {self.pack(mb * 1e6) * 1e3:.1f} ms, "
            f"write into a slot {self.kv_write(mb * 1e6) * 1e3:.1f} ms, "
            + ", ".join(f"{p} {c(mb * 1e6) * 1e3:.1f} ms" for p, c in sorted(self.handoff.items())),
        ]
        return "\n".join(lines)


def fit_profile(
    samples: dict[str, Samples], kv_bytes_per_token: int, breaks: tuple[int, ...] = ()
) -> Profile:
    """The cost models from `disagg profile`'s raw samples: each kind a list of points
    (prefill [tokens, s], chunk [tokens, start, s], decode [rows, positions, s], kv_write /
    pack / shm / network [bytes, s]); mixed_factor is left at 1 (measure.run_profile sets it).
    `breaks`: prompt row counts where the engine changes kernel (planner/costs.py)."""

    def cols(name: str) -> list[list[float]]:
        return [list(c) for c in zip(*samples[name], strict=True)]

    pre, chunk, dec, write = cols("prefill"), cols("chunk"), cols("decode"), cols("kv_write")
    return Profile(
        prefill=fit_piecewise(pre[0], pre[1], breaks),
        chunk=fit_chunk([int(x) for x in chunk[0]], [int(x) for x in chunk[1]], chunk[2], breaks),
        decode=fit_decode([int(x) for x in dec[0]], [int(x) for x in dec[1]], dec[2]),
        pack=fit_linear(*cols("pack")),
        kv_write=fit_linear(write[0], write[1]),
        handoff={SHM: fit_linear(*cols(SHM)), NETWORK: fit_linear(*cols(NETWORK))},
        kv_bytes_per_token=kv_bytes_per_token,
        samples=samples,
    )
