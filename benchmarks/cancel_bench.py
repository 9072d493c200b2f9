#!/usr/bin/env python3
"""A client that disconnects 100 ms into a 2,000-token prefill (issue 27, item 3): how long
until that prefill worker takes the next request, and until the KV bytes are freed, on a
real tritonserver, against a whole prefill of the same length (what the worker was held for
before prefills could be cancelled).

Two paths: "bls" (router -> orchestrator -> prefill within one server: the cancel travels as
a mark, cancel.py) and "network" (the orchestrator's pools are the server's own models over
gRPC, as a frontend's are on other servers: the cancel travels as the gRPC call's
cancellation, the payload as a kvnet lease whose bytes disagg_kv_leased_bytes shows).

Per round: `whole` a fresh 2,000-token prompt's first token; then another's stream, closed
after --leave-ms; at once a short request, whose first token (`next`) waits for the prefill
worker; `stopped`: disconnect -> disagg_prefill_cancelled_total counts it; `kv freed`:
disconnect -> no leased bytes (network; none were leased when the prefill stopped first).

    python benchmarks/cancel_bench.py [--rounds 3] [--paths bls,network] [--leave-ms 100]

Prints a table and writes results/cancel_bench.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import tritonclient.grpc as grpcclient

from disagg import contracts as C
from disagg.client import grpc_inputs
from disagg.engine.tokenizer import Tokenizer
from disagg.serve.server import TritonServer, free_ports
from disagg.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]


def scrape(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def prompt(tok: Tokenizer, seed: int, n: int) -> str:
    """About n tokens of text no earlier round shares a block with (no prefix cache hit)."""
    body = " ".join(f"Round {seed} note {i}: the tide, the boats, the weather." for i in range(n))
    return tok.decode(tok.encode(body)[:n])


def stream(url: str, text: str) -> tuple[grpcclient.InferenceServerClient, list]:
    client, got = grpcclient.InferenceServerClient(url), []
    client.start_stream(callback=lambda result, error: got.append((time.monotonic(), error)))
    inputs = grpc_inputs({C.TEXT_INPUT: text, C.MAX_TOKENS: 1, C.STREAM: True})
    client.async_stream_infer("router", inputs, enable_empty_final_response=True)
    return client, got


def first_token_at(url: str, text: str) -> float:
    client, got = stream(url, text)
    while not got:
        time.sleep(0.002)
    client.stop_stream()
    client.close()
    if got[0][1] is not None:
        raise RuntimeError(f"request failed: {got[0][1]}")
    return got[0][0]


def until(check, timeout_s: float = 30.0, poll_s: float = 0.005) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            return float("nan")
        time.sleep(poll_s)
    return time.monotonic()


def one_round(
    server: TritonServer, tok: Tokenizer, seed: int, n: int, leave_s: float
) -> dict[str, float]:
    url, metrics = server.endpoints.grpc, server.endpoints.metrics
    whole_text, left_text = prompt(tok, seed, n), prompt(tok, seed + 1, n)
    t = time.monotonic()
    whole = first_token_at(url, whole_text) - t
    cancelled = scrape(metrics, "disagg_prefill_cancelled_total")
    client, got = stream(url, left_text)
    time.sleep(leave_s)
    assert not got, "the prefill ended before the client left"
    client.stop_stream(cancel_requests=True)
    left = time.monotonic()
    client.close()
    nxt = first_token_at(url, "Hi") - left
    stopped = until(lambda: scrape(metrics, "disagg_prefill_cancelled_total") > cancelled) - left
    freed = until(lambda: scrape(metrics, "disagg_kv_leased_bytes") == 0.0) - left
    return {"whole_s": whole, "next_s": nxt, "stopped_s": stopped, "kv_freed_s": max(freed, 0)}


def serve(path: str, engine_dir: str) -> TritonServer:
    http, grpc, metrics = free_ports(3)
    s = ServeSettings(
        engine_dir=engine_dir, build_dir=tempfile.mkdtemp(prefix=f"cancel-{path}-"),
        http_port=http, grpc_port=grpc, metrics_port=metrics, mode="disaggregated",
        gateway_enabled=False, kv_lease_s=120.0,
    )  # fmt: skip
    if path == "network":
        os.environ.setdefault(C.TOKEN_ENV, "cancel-bench-token-0123456789")
        own = f"127.0.0.1:{grpc}"
        s = dataclasses.replace(s, prefill_replicas=own, decode_replicas=own)
    server = TritonServer(s, admin_key="bench-admin-key").start()
    server.wait_ready(timeout_s=300)
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", default=str(ROOT / "engines" / "smollm2-135m-instruct"))
    p.add_argument("--paths", default="bls,network")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--leave-ms", type=float, default=100.0)
    p.add_argument("--out", type=Path, default=ROOT / "results")
    a = p.parse_args(argv)
    table: dict[str, list[dict[str, float]]] = {}
    tok = Tokenizer(a.engine_dir)
    for path in a.paths.split(","):
        server = serve(path, a.engine_dir)
        try:
            first_token_at(server.endpoints.grpc, "Warm up.")
            table[path] = [
                one_round(server, tok, 10 * r + 5 * (path == "network"), a.tokens, a.leave_ms / 1e3)
                for r in range(a.rounds)
            ]
        finally:
            server.stop()
    cols = ("whole_s", "next_s", "stopped_s", "kv_freed_s")
    print(f"{a.tokens}-token prefill, client gone after {a.leave_ms:.0f} ms; medians of "
          f"{a.rounds} rounds (s)")  # fmt: skip
    print(f"{'path':8} {'whole prefill':>14} {'next 1st token':>15} {'stopped':>8} {'kv freed':>9}")
    for path, rows in table.items():
        med = [statistics.median(r[c] for r in rows) for c in cols]
        print(f"{path:8} {med[0]:14.2f} {med[1]:15.2f} {med[2]:8.2f} {med[3]:9.2f}")
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / "cancel_bench.json"
    out.write_text(
        json.dumps({"tokens": a.tokens, "leave_ms": a.leave_ms, "rounds": table}, indent=1)
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
