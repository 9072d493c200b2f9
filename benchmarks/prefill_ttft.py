#!/usr/bin/env python3
"""Prefill speed as a user sees it: the time to first token of one prompt alone, by prompt
length, and of a burst of short prompts sent at once, served by disagg and by `vllm serve`,
one server at a time (each is stopped before the next starts: vLLM's idle worker spins).

Nothing is cached (prefix caching off on both sides; every prompt's text is its own), two
output tokens, greedy, through the OpenAI chat API (the official `openai` package). Per
length the best of `--tries` is kept (the machine's noise only ever adds). The servers and
the client are prefix_bench.py's.

    python benchmarks/prefill_ttft.py [--servers disagg vllm] [--mode colocated]
        [--lengths 150 500 1500] [--burst 16] [--vllm-dtype bfloat16]

Prints a table; writes results/prefill_ttft.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prefix_bench as pb  # noqa: E402  (its servers and chat client)

ROOT = Path(__file__).resolve().parents[1]


async def measure(url: str, a) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key=pb.API_KEY, timeout=900, max_retries=0)
    try:
        await pb.chat(client, [{"role": "user", "content": "Hello there."}], 2)  # warm-up
        alone = []
        for n in a.lengths:
            best, tokens = float("inf"), 0
            for i in range(a.tries):
                text = pb.words(n, 7000 + 10 * n + i)
                r, _ = await pb.chat(client, [{"role": "user", "content": text}], 2)
                if r.error:
                    raise RuntimeError(r.error)
                best, tokens = min(best, r.ttft_s), r.prompt_tokens
            alone.append({"prompt_tokens": tokens, "ttft_s": best, "tok_s": tokens / best})
            print(f"   {tokens} tokens alone: TTFT {best:.3f} s", flush=True)
        msgs = [[{"role": "user", "content": pb.words(150, 9000 + i)}] for i in range(a.burst)]
        done = await asyncio.gather(*(pb.chat(client, m, 2) for m in msgs))
        ttft = sorted(r.ttft_s for r, _ in done)
        burst = {
            "prompts": a.burst,
            "prompt_tokens": sum(r.prompt_tokens for r, _ in done),
            "ttft_p50_s": statistics.median(ttft),
            "ttft_last_s": ttft[-1],
            "errors": sum(bool(r.error) for r, _ in done),
        }
        return {"alone": alone, "burst": burst}
    finally:
        await client.close()


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, r in res["servers"].items():
        xs = [x["prompt_tokens"] for x in r["alone"]]
        ax.plot(xs, [x["tok_s"] for x in r["alone"]], marker="o", label=name)
    ax.set_xlabel("prompt tokens (alone)")
    ax.set_ylabel("prefill tokens/s (prompt / TTFT)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    p.add_argument("--servers", nargs="+", choices=("disagg", "vllm"), default=["disagg", "vllm"])
    p.add_argument("--mode", default="colocated", help="disagg's serving mode")
    p.add_argument("--lengths", type=int, nargs="+", default=[150, 500, 1500])
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--vllm-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--out", default=str(ROOT / "results" / "prefill_ttft.json"))
    a = p.parse_args()
    a.cache_tokens, a.concurrency = 0, a.burst  # (prefix_bench's server options)
    a.work_dir = tempfile.mkdtemp(prefix="prefill-ttft-")
    res: dict = {"command": " ".join(sys.argv), "servers": {}}
    for name in a.servers:
        print(f"== {name}: starting", flush=True)
        server = pb.vllm_server(a, False) if name == "vllm" else pb.disagg_server(a, False)
        with server as endpoint:
            res["servers"][name] = asyncio.run(measure(endpoint.url, a))
    print("\n| server | " + " | ".join(f"~{n} tokens alone" for n in a.lengths) + " | burst "
          f"{a.burst} x ~150: TTFT p50 / last |")  # fmt: skip
    print("|---" * (len(a.lengths) + 2) + "|")
    for name, r in res["servers"].items():
        cells = [f"{x['ttft_s']:.3f} s ({x['tok_s']:.0f} tok/s)" for x in r["alone"]]
        b = r["burst"]
        cells.append(f"{b['ttft_p50_s']:.2f} / {b['ttft_last_s']:.2f} s ({b['errors']} errors)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
