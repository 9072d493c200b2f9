"""`disagg profile`'s measurements: the real engine (engine/model.py `Llama`,
engine/llm_engine.py `PrefillEngine` and `DecodeEngine`) on this machine, timed piece by
piece, then fitted into a Profile (planner/profile.py). Imports torch.

    prefill   PrefillEngine.prefill by prompt length (first token sampled, K/V returned)
    chunk     Llama.prefill_chunk by chunk size and start position
    decode    DecodeEngine.step() with B sequences at context T (their K/V imported as
              zeros: the same arithmetic as real K/V, without prefilling B * T tokens)
    mixed     DecodeEngine.step() while a co-located prompt is chunked beside B sequences:
              its recorded work (planner/recording.py) costed by the fits above, against
              the measured step -> profile.mixed_factor
    kv_write  KVCacheSlots.write of a payload into a slot
    pack, shm, network   planner/handoff.py

Times are medians where a point is repeated. On CUDA every timed call ends in a copy to the
host or an explicit synchronize, so a time is the device's work, not its launch.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from disagg.engine.config import EngineConfig, load_model_args
from disagg.engine.kv_payload import KVPayload
from disagg.engine.llm_engine import DecodeEngine, PrefillEngine, PrefillResult
from disagg.engine.model import KVCacheSlots, Llama
from disagg.engine.quant import DIRECT_ROWS
from disagg.engine.sequence import SamplingParams
from disagg.planner import handoff, machine
from disagg.planner.decode_sim import CHUNK, DECODE, PREFILL, StepWork
from disagg.planner.profile import Profile, Samples, fit_profile
from disagg.planner.recording import Recorder

Log = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    """The points measured."""

    prefill_tokens: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    chunk_starts: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_steps: int  # timed steps per (batch, context)
    mixed: tuple[tuple[int, int, int], ...]  # (decoding sequences, their context, prompt tokens)
    kv_tokens: tuple[int, ...]  # payload sizes, in prompt tokens
    reps: int


QUICK = Plan(
    prefill_tokens=(32, 256, 1024), chunk_sizes=(64, 256), chunk_starts=(0, 1024),
    batches=(1, 4, 16), contexts=(128, 1024), decode_steps=4, mixed=((4, 512, 320),),
    kv_tokens=(64, 512, 2000), reps=1,
)  # fmt: skip
FULL = Plan(
    # 64 and 65: either side of the block kernel's last row count (quant.DIRECT_ROWS)
    prefill_tokens=(16, 32, 64, 65, 128, 256, 512, 1024, 1536, 2000),
    chunk_sizes=(16, 32, 64, 65, 128, 256, 512), chunk_starts=(0, 512, 1024, 1536),
    batches=(1, 2, 4, 8, 16, 32), contexts=(64, 512, 1024, 1900), decode_steps=8,
    mixed=((1, 256, 640), (8, 512, 640), (16, 1024, 640)),
    kv_tokens=(16, 128, 512, 1024, 2000), reps=3,
)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def _prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(100, 40000, n)]


def measure_prefill(model: Llama, plan: Plan) -> Samples:
    config = EngineConfig(max_model_len=model.args.max_context, prefix_cache_tokens=0)
    engine = PrefillEngine(model, config, reuse_kv_buffers=True)
    params = SamplingParams(max_tokens=1)
    engine.prefill("warm", _prompt(16, 0), params)
    out = []
    for n in plan.prefill_tokens:
        n = min(n, model.args.max_context - 1)
        ids = _prompt(n, n)
        for _ in range(plan.reps):
            out.append([n, _timed(lambda: engine.prefill("p", ids, params), model.device)])  # noqa: B023
    return out


def measure_chunks(model: Llama, plan: Plan) -> Samples:
    cache = KVCacheSlots(model.args, 1, model.args.max_context, device=model.device)
    out = []
    for n in plan.chunk_sizes:
        ids = _prompt(n, n)
        model.prefill_chunk(ids, 0, cache, 0)  # warm
        for start in plan.chunk_starts:
            if start + n > model.args.max_context:
                continue
            for _ in range(plan.reps):
                s = _timed(lambda: model.prefill_chunk(ids, start, cache, 0).cpu(), model.device)  # noqa: B023
                out.append([n, start, s])
    return out


def _decode_engine(
    model: Llama, batch: int, context: int, extra: int, slots: int = 0
) -> DecodeEngine:
    """A decode engine with `batch` sequences at `context` tokens, admitted (their K/V
    imported as zeros) and stepped once."""
    config = EngineConfig(
        max_num_seqs=slots or batch, max_model_len=min(context + extra, model.args.max_context),
        prefault_kv=True, prefix_cache_tokens=0,
    )  # fmt: skip
    engine = DecodeEngine(model, config, eos_token_ids=set())
    engine.cache.prefaulted.wait()  # (not beside the timings)
    a = model.args
    zeros = np.zeros((a.n_layers, a.n_kv_heads, context, a.head_dim), np.float32)
    kv = KVPayload.from_arrays(a, zeros, zeros)
    params = SamplingParams(max_tokens=extra - 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", params, prefill=PrefillResult(f"d{i}", 1, kv, 0, 0.0))
    engine.step()
    return engine


def measure_decode(model: Llama, plan: Plan, log: Log) -> Samples:
    """[rows, positions, seconds] per timed step."""
    out = []
    for batch in plan.batches:
        for context in plan.contexts:
            context = min(context, model.args.max_context - plan.decode_steps - 8)
            engine = _decode_engine(model, batch, context, plan.decode_steps + 8)
            engine.step()  # warm
            for _ in range(plan.decode_steps):
                positions = max(s.num_cached_tokens for s in engine.scheduler.running) + 1
                out.append([batch, positions, _timed(engine.step, model.device)])
            log(f"  decode batch {batch:>3} at {context:>4} positions: {out[-1][2] * 1e3:7.1f} ms")
            del engine
            gc.collect()
    return out


def measure_mixed(model: Llama, plan: Plan) -> list[tuple[StepWork, float]]:
    """(what the step ran, its seconds) for each step that chunked a prompt beside a batch."""
    out = []
    for batch, context, prompt_len in plan.mixed:
        engine = _decode_engine(model, batch, context, prompt_len + 16, slots=batch + 1)
        rec = Recorder(engine)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.add_request("prompt", params, prompt_ids=_prompt(prompt_len, prompt_len))
        (prompt,) = [s for s in engine.scheduler.waiting if s.request_id == "prompt"]
        while not prompt.output_ids:  # until its last chunk gave its first token
            seconds = _timed(engine.step, model.device)
            out.append((rec.take(), seconds))
        del engine, rec
        gc.collect()
    return out


def measure_kv_write(model: Llama, plan: Plan) -> Samples:
    a = model.args
    cache = KVCacheSlots(a, 1, a.max_context, prefault=True, device=model.device)
    cache.prefaulted.wait()  # (not beside the timings)
    out = []
    for n in plan.kv_tokens:
        n = min(n, a.max_context)
        k = np.zeros((a.n_layers, a.n_kv_heads, n, a.head_dim), np.float32)
        cache.write(0, k, k)  # warm
        times = [_timed(lambda: cache.write(0, k, k), model.device) for _ in range(plan.reps)]  # noqa: B023
        out.append([float(n * a.kv_bytes_per_token), statistics.median(times)])
    return out


def run_profile(
    engine_dir: str | Path,
    device: str = "cpu",
    compute_dtype: str = "auto",
    weights: str = "auto",
    threads: int = 0,
    quick: bool = False,
    log: Log = print,
    activations: str = "auto",
) -> Profile:
    """Measure everything in the plan, fit, and return the profile (not yet saved).
    `activations` as the pools' decode_activations setting (its default: what is served)."""
    if threads:
        torch.set_num_threads(threads)
    plan = QUICK if quick else FULL
    model = Llama.load(engine_dir, compute_dtype, device, weights, activations)
    args = load_model_args(engine_dir)
    samples: dict[str, Samples] = {}
    steps: list[tuple[str, Callable[[], Samples]]] = [
        ("prefill", lambda: measure_prefill(model, plan)),
        ("chunk", lambda: measure_chunks(model, plan)),
        ("decode", lambda: measure_decode(model, plan, log)),
        ("kv_write", lambda: measure_kv_write(model, plan)),
    ]
    for name, fn in steps:
        t = time.perf_counter()
        log(f"measuring {name} ...")
        samples[name] = fn()
        log(f"  {name}: {len(samples[name])} samples in {time.perf_counter() - t:.1f} s")
    log("measuring KV hand-off paths ...")
    samples.update(handoff.measure(args, plan.kv_tokens, max(plan.reps, 2)))
    log("measuring chunk-plus-decode steps ...")
    mixed = measure_mixed(model, plan)
    profile = fit_profile(samples, args.kv_bytes_per_token, breaks=(DIRECT_ROWS,))
    ratios = []
    for work, seconds in mixed:
        kinds = {k for k, _, _ in work.ops}
        samples.setdefault("mixed", []).append([work.seconds(profile), seconds])
        if DECODE in kinds and kinds & {CHUNK, PREFILL}:
            ratios.append(seconds / work.seconds(profile))
    return replace(
        profile,
        mixed_factor=float(statistics.median(ratios)) if ratios else 1.0,
        machine=machine.describe(str(model.device)),
        model={"name": Path(engine_dir).name, "fingerprint": args.fingerprint,
               "n_layers": args.n_layers, "dim": args.dim, "max_context": args.max_context,
               "weights": str(getattr(model, "weights", model.compute_dtype)),
               "activations": str(getattr(model, "activations", "float32"))},
        device=str(model.device), dtype=model.compute_dtype, threads=torch.get_num_threads(),
        quick=quick, created=datetime.now(UTC).isoformat(timespec="seconds"), samples=samples,
    )  # fmt: skip
