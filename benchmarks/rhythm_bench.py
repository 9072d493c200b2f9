#!/usr/bin/env python3
"""The token rhythm of running streams while long prompts arrive, served, per mode (issue 24,
step 2): through the OpenAI gateway, a few streams decode steadily and a long prompt arrives
every `--every` seconds. Per mode (and per server settings, "mode:setting=value,..." as
served_bench takes them): the gaps between the streams' tokens while the long prompts are
served (p50, p99, p99/p50: the target is <= 3), the long prompts' time to first token, and
the streams' tokens per second over that window. Each mode's server runs alone, in turn;
rounds interleave the modes.

    python benchmarks/rhythm_bench.py [--modes auto colocated disaggregated conditional]
        [--streams 4] [--prompt 1600] [--longs 3] [--every 2] [--rounds 2]
Prints a table and writes results/rhythm_bench.json and results/rhythm_bench.png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

from served_bench import API_KEY, server_settings

from disagg.bench.runner import GatewayTarget, run_one
from disagg.bench.workloads import PromptMaker, RequestSpec
from disagg.engine.tokenizer import Tokenizer
from disagg.serve.gateway_process import GatewayProcess
from disagg.serve.server import TritonServer, free_ports

ROOT = Path(__file__).resolve().parents[1]
nan = float("nan")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one_round(target: GatewayTarget, maker: PromptMaker, a, r: int) -> dict:
    """Streams first; once they run, the long prompts at `every`-second intervals."""

    def spec(i: int, cls: str, n: int, out: int) -> RequestSpec:
        return RequestSpec(i, cls, 0.0, n, out, {})

    streams = [
        asyncio.create_task(
            run_one(target, spec(i, "stream", 64, a.stream_tokens), maker.text(64, i + r))
        )
        for i in range(a.streams)
    ]
    await asyncio.sleep(a.lead)
    longs = []
    for j in range(a.longs):
        text = maker.text(a.prompt, 100 + j + 10 * r)  # no prefix shared with another
        longs.append(asyncio.create_task(run_one(target, spec(50 + j, "long", a.prompt, 4), text)))
        await asyncio.sleep(a.every)
    done_longs = await asyncio.gather(*longs)
    window = (done_longs[0].send_s, max(t.chunk_s[0] if t.chunk_s else t.end_s for t in done_longs))
    done_streams = await asyncio.gather(*streams)
    gaps, tokens = [], 0
    for t in done_streams:  # every gap that overlaps the window (a stall may straddle an end)
        pairs = zip(t.chunk_s, t.chunk_s[1:], strict=False)
        gaps += [b - a_ for a_, b in pairs if b >= window[0] and a_ <= window[1]]
        tokens += sum(window[0] <= s <= window[1] for s in t.chunk_s)
    errors = [t.error for t in (*done_streams, *done_longs) if t.error]
    span = window[1] - window[0]
    return {
        "itl_p50_ms": 1e3 * pct(gaps, 0.5),
        "itl_p99_ms": 1e3 * pct(gaps, 0.99),
        "itl_max_ms": 1e3 * max(gaps, default=float("nan")),
        "ratio": pct(gaps, 0.99) / pct(gaps, 0.5) if gaps else float("nan"),
        "long_ttft_p50_s": statistics.median([t.ttft for t in done_longs if t.ok] or [nan]),
        "stream_tok_s": tokens / span if span > 0 else float("nan"),
        "window_s": span,
        "num_gaps": len(gaps),
        "errors": errors,
    }


def measure(spec: str, a, maker: PromptMaker, rounds: list[int]) -> list[dict]:
    http, grpc, metrics, gw = free_ports(4)
    settings = dataclasses.replace(
        server_settings(spec),
        engine_dir=a.engine_dir, build_dir=tempfile.mkdtemp(),
        http_port=http, grpc_port=grpc, metrics_port=metrics, gateway_port=gw,
    )  # fmt: skip
    print(f"== {spec} (resolved: {settings.resolved_mode()[0]})", flush=True)
    out = []
    with TritonServer(settings) as server:
        server.wait_ready(timeout_s=240)
        gateway = GatewayProcess(settings, env={"DISAGG_API_KEYS": API_KEY}).start()
        try:
            gateway.wait_ready(timeout_s=60)

            async def go(r: int) -> dict:
                target = GatewayTarget(gateway.url, settings.served_model_name, API_KEY)
                try:
                    if r < 0:  # warm-up: one short request
                        await run_one(target, RequestSpec(0, "w", 0, 8, 4, {}), "Hi")
                        return {}
                    return await one_round(target, maker, a, r)
                finally:
                    await target.close()

            asyncio.run(go(-1))
            for r in rounds:
                result = asyncio.run(go(r))
                shown = [f"{k} {v:.2f}" for k, v in result.items() if isinstance(v, float)]
                shown += [f"errors {len(result['errors'])}"] if result["errors"] else []
                print(f"   round {r + 1}: " + ", ".join(shown), flush=True)
                out.append(result)
        finally:
            gateway.stop()
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    left.bar(names, [summary[n]["ratio"] for n in names], color="#3a7")
    left.axhline(3.0, color="#c33", linestyle="--", label="target p99/p50 = 3")
    left.set_ylabel("ITL p99 / p50 (median round; of two, the worse)")
    left.legend()
    right.bar(names, [summary[n]["long_ttft_p50_s"] for n in names], color="#37a")
    right.set_ylabel("long prompt TTFT p50 (s)")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("running streams' rhythm while long prompts arrive, through the gateway")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-dir", default=str(ROOT / "engines/smollm2-135m-instruct"))
    ap.add_argument("--modes", nargs="+", default=["auto", "colocated", "disaggregated"])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=600)
    ap.add_argument("--prompt", type=int, default=1600, help="long prompt tokens")
    ap.add_argument("--longs", type=int, default=3, help="long prompts per round")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between long prompts")
    ap.add_argument("--lead", type=float, default=3.0, help="seconds of streams before them")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results/rhythm_bench.json"))
    a = ap.parse_args()
    maker = PromptMaker(Tokenizer(a.engine_dir))
    runs: dict[str, list[dict]] = {m: [] for m in a.modes}
    for r in range(a.rounds):  # modes take turns, a round each
        for m in a.modes:
            runs[m] += measure(m, a, maker, [r])
    summary = {}
    print(f"\n{'mode':<34}{'ITL p50':>9}{'ITL p99':>9}{'p99/p50':>9}"
          f"{'long TTFT':>11}{'stream tok/s':>14}{'errors':>8}")  # fmt: skip
    for m, rs in runs.items():
        ranked = sorted(rs, key=lambda x: (math.isnan(x["ratio"]), x["ratio"]))
        mid = ranked[len(rs) // 2]  # the median round (of two, the worse)
        summary[m] = mid
        print(f"{m:<34}{mid['itl_p50_ms']:>7.0f}ms{mid['itl_p99_ms']:>7.0f}ms"
              f"{mid['ratio']:>9.2f}{mid['long_ttft_p50_s']:>10.2f}s"
              f"{mid['stream_tok_s']:>14.1f}{sum(len(x['errors']) for x in rs):>8}")  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "runs": runs, "summary": summary}, indent=1))
    plot(summary, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
