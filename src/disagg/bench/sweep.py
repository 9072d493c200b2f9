"""A rate sweep of one workload against one server: unloaded calibration requests, then each
offered rate in turn, with a progress bar. Returns raw timelines (JSON-ready); statistics
are computed afterwards (report.py), so SLOs can be set once for several servers."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Never

from tqdm import tqdm

from disagg.bench import workloads as W
from disagg.bench.runner import Progress, Target, run_one_at_a_time, run_open_loop
from disagg.bench.stats import Timeline

Sweep = dict[str, Any]  # JSON: config, label, unloaded (timelines), rates (rate -> timelines)


@dataclass(frozen=True)
class SweepConfig:
    workload: str
    rates: tuple[float, ...]
    num_requests: int = 24  # per rate, warm-up included
    warmup: int = 4  # first requests of each rate, by send time, left out of the statistics
    calibration_per_class: int = 3  # unloaded requests per class
    seed: int = 0


def _bar(total: int, desc: str) -> tuple[tqdm[Never], Progress]:  # (a bar over no iterable)
    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=True, dynamic_ncols=True)
    errors = [0]

    def update(t: Timeline) -> None:
        errors[0] += bool(t.error)
        bar.set_postfix(errors=errors[0], refresh=False)
        bar.update(1)

    return bar, Progress(update)


CALIBRATION_MAX_TOKENS = 32  # enough tokens for a steady TPOT, few enough to be quick


def calibration_specs(workload: W.Workload, per_class: int, seed: int) -> list[W.RequestSpec]:
    """A few requests of each class, drawn like the workload's own (seed offset), their
    outputs capped: unloaded TTFT and TPOT do not depend on the output length."""
    specs = W.build(workload, 1.0, 50 * per_class * len(workload.classes), seed + 1)
    chosen = []
    for c in workload.classes:
        chosen += [s for s in specs if s.cls == c.name][:per_class]
    return [replace(s, max_tokens=min(s.max_tokens, CALIBRATION_MAX_TOKENS)) for s in chosen]


def phase_prompts(
    prompts: W.PromptMaker, specs: list[W.RequestSpec], first: int
) -> tuple[Callable[[W.RequestSpec], str], int]:
    """The texts of one phase (the unloaded calibration, or one rate) and where the next
    phase's begin: each phase its own, so that a later rate does not find the prompts of an
    earlier one in the server's prefix cache (each rate draws the same seeded specs, so their
    indices repeat). A spec's text is PromptMaker.text at first + its index."""
    after = first + max((s.index for s in specs), default=-1) + 1
    return (lambda spec: prompts.text(spec.prompt_tokens, first + spec.index)), after


async def sweep(target: Target, cfg: SweepConfig, prompts: W.PromptMaker, label: str) -> Sweep:
    workload = W.WORKLOADS[cfg.workload]
    out: Sweep = {"config": asdict(cfg), "label": label, "unloaded": [], "rates": {}}
    specs = calibration_specs(workload, cfg.calibration_per_class, cfg.seed)
    prompt_for, texts = phase_prompts(prompts, specs, 0)
    bar, progress = _bar(len(specs), f"{label} {cfg.workload} unloaded")
    with bar:
        out["unloaded"] = [
            asdict(t) for t in await run_one_at_a_time(target, specs, prompt_for, progress)
        ]
    for rate in cfg.rates:
        specs = W.build(workload, rate, cfg.num_requests, cfg.seed)
        prompt_for, texts = phase_prompts(prompts, specs, texts)
        bar, progress = _bar(len(specs), f"{label} {cfg.workload} {rate:g}/s")
        with bar:
            timelines = await run_open_loop(target, specs, prompt_for, progress)
        out["rates"][str(rate)] = [asdict(t) for t in timelines]
    return out


def run_sweep(
    target_factory: Callable[[], Target], cfg: SweepConfig, prompts: W.PromptMaker, label: str
) -> Sweep:
    """`target_factory()` makes the Target inside the sweep's event loop."""

    async def main() -> Sweep:
        target = target_factory()
        try:
            return await sweep(target, cfg, prompts, label)
        finally:
            await target.close()

    return asyncio.run(main())
