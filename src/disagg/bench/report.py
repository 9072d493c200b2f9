"""Statistics, tables and plots from sweep results (sweep.py's JSON).

SLOs are set once per workload and class from the unloaded requests of every sweep in the
comparison (the best mode's p50, times a factor), so all modes are judged by one bar.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from disagg.bench.stats import (
    SLO,
    ClassSummary,
    Timeline,
    calibrate_slo,
    goodput_rate,
    measured,
    summarize,
)

if TYPE_CHECKING:
    from disagg.bench.sweep import Sweep

TARGET_ATTAINMENT = 0.9


class SweepSummary(TypedDict):
    """A sweep's statistics (summarize_sweep), per class and for "all" requests."""

    by_rate: dict[float, dict[str, ClassSummary]]  # offered rate -> class -> summary
    goodput: dict[str, float]  # class -> the highest rate that meets the SLO target


def timelines(raw: list[dict[str, Any]]) -> list[Timeline]:
    return [Timeline(**t) for t in raw]


def classes_of(sweep: Sweep) -> list[str]:
    return sorted({t["cls"] for t in sweep["unloaded"]})


def slos(
    sweeps: list[Sweep],
    ttft_factor: float,
    tpot_factor: float,
    overrides: dict[str, SLO] | None = None,
) -> dict[str, SLO]:
    """Per class: the factors times the lowest unloaded p50 among the sweeps, unless
    `overrides` sets the class's SLO outright."""
    out = dict(overrides or {})
    for cls in classes_of(sweeps[0]):
        if cls in out:
            continue
        per = [
            calibrate_slo([t for t in timelines(s["unloaded"]) if t.cls == cls], 1.0, 1.0)
            for s in sweeps
        ]
        out[cls] = SLO(
            ttft_factor * min(p.ttft_s for p in per), tpot_factor * min(p.tpot_s for p in per)
        )
    return out


def summarize_sweep(sweep: Sweep, slo: dict[str, SLO]) -> SweepSummary:
    """{rate: {class or "all": ClassSummary}} and {class or "all": goodput rate}."""
    warmup = sweep["config"]["warmup"]
    by_rate = {}
    for rate, raw in sweep["rates"].items():
        ts = measured(timelines(raw), warmup)
        by_rate[float(rate)] = {c: summarize(ts, c, slo) for c in [*classes_of(sweep), "all"]}
    goodput = {
        c: goodput_rate(
            {r: s[c].slo_attainment or 0.0 for r, s in by_rate.items()}, TARGET_ATTAINMENT
        )
        for c in [*classes_of(sweep), "all"]
    }
    return {"by_rate": by_rate, "goodput": goodput}


def parse_slo_overrides(items: list[str]) -> dict[str, SLO]:
    """["short=500:80", ...] (class=TTFT ms:TPOT ms) -> {class: SLO}."""
    out = {}
    for item in items:
        try:
            cls, values = item.split("=", 1)
            ttft_ms, tpot_ms = (float(v) for v in values.split(":"))
        except ValueError:
            raise ValueError(f"--slo {item!r}: expected CLASS=TTFT_MS:TPOT_MS") from None
        out[cls] = SLO(ttft_ms / 1e3, tpot_ms / 1e3)
    return out


def detail_table(results: dict[str, SweepSummary]) -> str:
    """Every statistic: per mode, rate and class, mean / p50 / p90 / p99 in ms."""
    head = (
        "| mode | rate | class | n | TTFT mean/p50/p90/p99 | TPOT mean/p50/p90/p99 "
        "| ITL mean/p50/p90/p99 | e2e mean/p50/p90/p99 | tok/s | SLO met | goodput req/s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for mode, res in results.items():
        for rate, by_cls in sorted(res["by_rate"].items()):
            for cls, s in by_cls.items():
                dists = " | ".join(
                    "/".join(_ms(getattr(d, f)).strip() for f in ("mean", "p50", "p90", "p99"))
                    for d in (s.ttft, s.tpot, s.itl, s.e2e)
                )
                lines.append(
                    f"| {mode} | {rate:g} | {cls} | {s.num_requests} | {dists} "
                    f"| {s.output_tokens_per_s:.0f} | {100 * (s.slo_attainment or 0):.0f}% "
                    f"| {s.goodput_requests_per_s or 0:.2f} |"
                )
    return "\n".join(lines) + "\n"


def summary_json(results: dict[str, SweepSummary], slo: dict[str, SLO]) -> dict[str, Any]:
    return {
        "slo": {c: {"ttft_s": v.ttft_s, "tpot_s": v.tpot_s} for c, v in slo.items()},
        "modes": {
            mode: {
                "goodput_rate": res["goodput"],
                "by_rate": {
                    str(rate): {c: s.to_dict() for c, s in by_cls.items()}
                    for rate, by_cls in res["by_rate"].items()
                },
            }
            for mode, res in results.items()
        },
    }


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1e3:.0f}"


def markdown_table(workload: str, results: dict[str, SweepSummary], slo: dict[str, SLO]) -> str:
    """One row per mode and class: attainment at each rate, latency at the highest rate."""
    modes = list(results)
    rates = sorted(results[modes[0]]["by_rate"])
    top = rates[-1]
    head = (
        "| mode | class | "
        + " | ".join(f"SLO met @{r:g}/s" for r in rates)
        + f" | goodput (req/s) | TTFT p50/p99 ms @{top:g}/s | TPOT p50/p99 ms | ITL p99 ms "
        "| tok/s | errors |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for mode in modes:
        res = results[mode]
        for cls in [c for c in res["by_rate"][top] if c != "all"] + ["all"]:
            if cls == "all" and len(res["by_rate"][top]) == 2:
                continue  # one class: "all" repeats it
            s = res["by_rate"][top][cls]
            att = " | ".join(
                f"{100 * (res['by_rate'][r][cls].slo_attainment or 0):.0f}%" for r in rates
            )
            errors = sum(res["by_rate"][r][cls].num_errors for r in rates)
            lines.append(
                f"| {mode} | {cls} | {att} | {res['goodput'][cls]:g} | "
                f"{_ms(s.ttft.p50)} / {_ms(s.ttft.p99)} | {_ms(s.tpot.p50)} / {_ms(s.tpot.p99)} "
                f"| {_ms(s.itl.p99)} | {s.output_tokens_per_s:.0f} | {errors} |"
            )
    slo_text = ", ".join(
        f"{c}: TTFT <= {_ms(v.ttft_s)} ms, TPOT <= {_ms(v.tpot_s)} ms" for c, v in slo.items()
    )
    return f"**{workload}** (SLO {slo_text})\n\n" + "\n".join(lines) + "\n"


def plot_workload(
    workload: str,
    sweeps: dict[str, Sweep],
    results: dict[str, SweepSummary],
    slo: dict[str, SLO],
    path: Path,
) -> None:
    """Four panels: SLO attainment vs offered rate, TTFT and TPOT CDFs at the highest rate,
    and a TTFT/TPOT scatter (each point a request) with the SLO box."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(1, 5, figsize=(22, 4.2))
    top = max(float(r) for r in next(iter(sweeps.values()))["rates"])
    for mode, res in results.items():
        rates = sorted(res["by_rate"])
        ax[0].plot(
            rates, [100 * (res["by_rate"][r]["all"].slo_attainment or 0) for r in rates], "o-",
            label=mode,
        )  # fmt: skip
        ax[4].plot(
            rates, [res["by_rate"][r]["all"].goodput_requests_per_s or 0 for r in rates], "o-",
            label=mode,
        )  # fmt: skip
        sweep = sweeps[mode]
        warmup = sweep["config"]["warmup"]
        ts = [t for t in measured(timelines(sweep["rates"][_key(sweep, top)]), warmup) if t.ok]
        for i, values in enumerate(([t.ttft for t in ts], [t.tpot for t in ts if t.tpot])):
            v = np.sort(values)
            ax[1 + i].plot(v * 1e3, np.arange(1, len(v) + 1) / max(len(v), 1), label=mode)
        ax[3].scatter(
            [t.ttft * 1e3 for t in ts if t.tpot], [t.tpot * 1e3 for t in ts if t.tpot],
            s=12, alpha=0.7, label=mode,
        )  # fmt: skip
    ax[0].axhline(100 * TARGET_ATTAINMENT, color="grey", ls="--", lw=1)
    ax[0].set(xlabel="offered rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    ax[1].set(xlabel=f"TTFT (ms) @ {top:g}/s", ylabel="CDF", xscale="log")
    ax[2].set(xlabel=f"TPOT (ms) @ {top:g}/s", ylabel="CDF")
    ax[3].set(xlabel=f"TTFT (ms) @ {top:g}/s", ylabel="TPOT (ms)", xscale="log")
    ax[4].set(xlabel="offered rate (req/s)", ylabel="goodput (SLO-meeting req/s)")
    for s in slo.values():
        ax[1].axvline(s.ttft_s * 1e3, color="grey", ls=":", lw=1)
        ax[2].axvline(s.tpot_s * 1e3, color="grey", ls=":", lw=1)
        ax[3].add_patch(
            Rectangle((1, 0), s.ttft_s * 1e3, s.tpot_s * 1e3, fill=False, ls=":", ec="grey")
        )
    from matplotlib.ticker import NullFormatter

    for a in (ax[1], ax[3]):  # log axes: label the decades only
        a.xaxis.set_minor_formatter(NullFormatter())
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"{workload}: SmolLM2-135M, 2 CPU cores (dotted: SLOs)")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def _key(sweep: Sweep, rate: float) -> str:
    return next(str(k) for k in sweep["rates"] if float(k) == rate)


def paired_bars(ax: Any, names: list[str], ways: dict[str, list[float]], ylabel: str,
                title: str) -> None:  # fmt: skip
    """One group of bars a case, a bar a way (an A/B benchmark's seconds: lower is better)."""
    width = 0.8 / len(ways)
    for w, (label, values) in enumerate(ways.items()):
        at = [i + (w - (len(ways) - 1) / 2) * width for i in range(len(names))]
        ax.bar(at, values, width, label=label)
    ax.set_xticks(list(range(len(names))), names)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
