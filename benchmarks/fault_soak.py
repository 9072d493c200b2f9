#!/usr/bin/env python3
"""A long run with faults (issue 27, item 5): N greedy streams through the gateway against a
real tritonserver started here (its stub supervisor on, as `disagg serve` runs it), with a
random stub (decode, prefill, orchestrator, router, tokenizer) killed (SIGKILL) every
`--kill-every` seconds.

Every request is counted: completed with its greedy reply (the reply each prompt got on the
undisturbed server before the first kill), completed with another text (wrong), ended with a
clear error (an HTTP status or a closed stream, with its kind), or hung (no end within
`--hung-s`). When tritonserver itself dies (python_backend's lock_exception abort at a stub
kill: docs/reliability.md), it is started again as `disagg serve` does, and counted. Once
stubs have died, tritonserver is replaced the way `disagg serve` replaces it
(serve/recycle.py: hold new gateway requests, drain, restart; `--recycle-after-faults`), and
counted.
Threads, RSS and mapped /dev/shm regions of tritonserver and its stubs are read at the start,
after the first fault and at the end. Prints a progress line a minute and tables at the end;
writes results/fault_soak.json.

    python benchmarks/fault_soak.py [--minutes 30] [--streams 16] [--kill-every 120]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import openai

from disagg.serve import recycle
from disagg.serve.__main__ import recycle_triton
from disagg.serve.gateway_process import GatewayProcess
from disagg.serve.server import TritonServer, free_ports
from disagg.serve.supervisor import stub_processes
from disagg.settings import ServeSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import PROMPTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-fault-soak"
MODELS = ("decode", "prefill", "orchestrator", "router", "tokenizer")
OUTCOMES = ("completed", "wrong", "clear error", "hung")


def resources(server_pid: int) -> dict[str, int]:
    """Threads, RSS (MB) and /dev/shm mappings of tritonserver and its live stubs."""
    out = {"threads": 0, "rss_mb": 0, "shm_maps": 0, "stubs": 0}
    for pid in [server_pid, *stub_processes(server_pid)]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out["threads"] += int(fields["Threads"])
        out["rss_mb"] += int(fields["VmRSS"].split()[0]) // 1024
        regions = {line.split(None, 5)[5] for line in maps.splitlines() if "/dev/shm/" in line}
        out["shm_maps"] += len({r.removesuffix(" (deleted)") for r in regions})
        out["stubs"] += pid != server_pid
    return out


class Run:
    """The server (restarted when it dies), the tally and the kills."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.server = TritonServer(settings).start()
        self.server.wait_ready(timeout_s=300)
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.error_kinds: dict[str, int] = {}
        self.error_samples: dict[str, str] = {}  # kind -> its first message
        self.kills: list[tuple[float, str]] = []
        self.restarts = 0
        self.recycles: list[tuple[float, str]] = []  # when, why
        self.recycler = recycle.Recycler.for_settings(settings)
        self.recycler.settle(self.server.proc.pid)

    def tally(self, outcome: str, kind: str = "", message: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if kind:
                self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
                self.error_samples.setdefault(kind, message[:300])

    def kill_one(self, rng: random.Random, t0: float) -> None:
        model = rng.choice(MODELS)
        stubs = [p for p, (m, _) in stub_processes(self.server.proc.pid).items() if m == model]
        if stubs:
            os.kill(rng.choice(stubs), signal.SIGKILL)
            self.kills.append((round(time.monotonic() - t0, 1), model))

    def keep_alive(self, gateway: GatewayProcess, t0: float) -> None:
        """tritonserver gone (its own abort): start it again; what dead stubs left over the
        budget: replace it; both as `disagg serve` does."""
        if self.server.proc.poll() is not None:
            self.server.stop()
            self.server = TritonServer(self.settings).start()
            self.server.wait_ready(timeout_s=300)
            self.restarts += 1
            self.recycler.settle(self.server.proc.pid)
        elif why := self.recycler.check(self.server.proc.pid):
            at = round(time.monotonic() - t0, 1)
            if not recycle_triton(self.settings, self.server, gateway, why):
                raise RuntimeError("replacing tritonserver failed")
            self.recycles.append((at, why))
            self.recycler.settle(self.server.proc.pid)


def stream_loop(url: str, run: Run, refs: dict[str, str], stop_at: float, a, i: int) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=a.hung_s)
    n = 0
    while time.monotonic() < stop_at:
        prompt = PROMPTS[(i + n) % len(PROMPTS)]
        n += 1
        try:
            text = "".join(
                chunk.choices[0].delta.content or ""
                for chunk in client.chat.completions.create(
                    model="smollm2-135m-instruct",
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=a.max_tokens,
                    temperature=0.0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                if chunk.choices
            )
            run.tally("completed" if text == refs[prompt] else "wrong")
        except openai.APITimeoutError:
            run.tally("hung")
        except openai.APIError as e:
            status = getattr(e, "status_code", None)
            run.tally("clear error", f"{type(e).__name__} {status or ''}".strip(), str(e))
            time.sleep(1)  # (a server restarting: do not spin on refusals)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--kill-every", type=float, default=120.0, help="seconds between kills")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--hung-s", type=float, default=180.0, help="a request open this long hung")
    p.add_argument("--mode", default="auto", help="the serving mode (the default: auto)")
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--recycle-after-faults", type=int,
                   default=ServeSettings.recycle_after_faults,
                   help="stubs dead before tritonserver is replaced (0: never)")  # fmt: skip
    p.add_argument("--engine-dir", default=str(ROOT / "engines" / "smollm2-135m-instruct"))
    p.add_argument("--out", default=str(ROOT / "results" / "fault_soak.json"))
    a = p.parse_args()

    http, grpc, metrics, gw = free_ports(4)
    settings = ServeSettings(
        engine_dir=a.engine_dir, build_dir=tempfile.mkdtemp(prefix="disagg-fault-soak-"),
        http_port=http, grpc_port=grpc, metrics_port=metrics, gateway_port=gw, mode=a.mode,
        decode_max_num_seqs=a.streams, gateway_rpm=0, gateway_tpm=0,
        recycle_after_faults=a.recycle_after_faults,
    )  # fmt: skip
    run = Run(settings)
    gateway = GatewayProcess(replace(settings), env={"DISAGG_API_KEYS": KEY}).start()
    marks: dict[str, dict[str, int]] = {}
    try:
        gateway.wait_ready()
        ref_client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
        refs = {
            q: ref_client.chat.completions.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": q}],
                max_tokens=a.max_tokens, temperature=0.0, extra_body={"ignore_eos": True},
            ).choices[0].message.content or ""
            for q in PROMPTS
        }  # fmt: skip
        marks["start"] = resources(run.server.proc.pid)
        rng, t0 = random.Random(a.seed), time.monotonic()
        stop_at = t0 + a.minutes * 60
        threads = [
            threading.Thread(target=stream_loop, args=(gateway.url, run, refs, stop_at, a, i))
            for i in range(a.streams)
        ]
        for t in threads:
            t.start()
        next_kill, next_line = t0 + a.kill_every, t0 + 60
        while any(t.is_alive() for t in threads):
            time.sleep(1)
            run.keep_alive(gateway, t0)
            now = time.monotonic()
            if now >= next_kill and now < stop_at - 30:  # (the last kill has time to recover)
                run.kill_one(rng, t0)
                next_kill += a.kill_every
                if len(run.kills) == 1:
                    time.sleep(20)  # the supervisor's reload
                    marks["after first fault"] = resources(run.server.proc.pid)
            if now >= next_line:
                next_line += 60
                print(f"[{(now - t0) / 60:5.1f} min] {run.counts}  kills {len(run.kills)}  "
                      f"server restarts {run.restarts}  replaced {len(run.recycles)}",
                      flush=True)  # fmt: skip
        time.sleep(15)  # the last reload
        run.keep_alive(gateway, t0)
        marks["end"] = resources(run.server.proc.pid)
    finally:
        gateway.stop()
        run.server.stop()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "minutes": a.minutes,
        "streams": a.streams, "mode": a.mode, "kill_every_s": a.kill_every, **run.counts,
        "error_kinds": run.error_kinds, "error_samples": run.error_samples,
        "kills": run.kills, "server_restarts": run.restarts, "replaced": run.recycles,
        "recycle_after_faults": a.recycle_after_faults,
        "resources": marks, "cpu": os.cpu_count(),
    }  # fmt: skip
    print(f"\n| fault soak ({a.streams} gateway streams, mode {a.mode}, a stub killed every "
          f"{a.kill_every:.0f} s, {a.minutes:.0f} min) | value |\n|---|---|")  # fmt: skip
    for k in (*OUTCOMES, "error_kinds", "error_samples", "server_restarts", "replaced"):
        print(f"| {k} | {result[k]} |")
    print(f"| kills | {len(run.kills)}: {', '.join(m for _, m in run.kills)} |")
    print("\n| resources (tritonserver + stubs) | threads | RSS (MB) | /dev/shm maps | stubs |")
    print("|---|---|---|---|---|")
    for mark, r in marks.items():
        print(f"| {mark} | {r['threads']} | {r['rss_mb']} | {r['shm_maps']} | {r['stubs']} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    return 0 if run.counts["hung"] == 0 and run.counts["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
