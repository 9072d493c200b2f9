#!/usr/bin/env python3
"""The request half of deploy/gpu_smoke.sh: against a running disagg (Triton + gateway), a
streamed and a non-streamed request through the gateway (OpenAI API) and through Triton gRPC,
each reply checked, then the KV hand-off and request metrics. Prints one line per step and
exits non-zero naming the first that fails.

    python3 deploy/smoke_check.py --triton-grpc HOST:8001 --metrics http://HOST:8002/metrics \\
        --gateway http://HOST:9000 --key sk-... --model NAME
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from disagg import contracts as C
from disagg.client import GrpcClient

PROMPT = "Name three colours of the rainbow."


def gateway_chat(base: str, key: str, model: str, stream: bool) -> tuple[str, str]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": stream,
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            choice = json.loads(r.read())["choices"][0]
            return choice["message"]["content"], choice["finish_reason"]
        text, finish = [], ""
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice.get("delta", {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
        return "".join(text), finish


def metric_sum(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--triton-grpc", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--gateway", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--model", required=True)
    a = p.parse_args(argv)
    grpc = GrpcClient(a.triton_grpc, timeout_s=300)
    inputs = {C.TEXT_INPUT: PROMPT, C.MAX_TOKENS: 24, C.APPLY_CHAT_TEMPLATE: True}

    def triton(stream: bool) -> tuple[str, str]:
        r = grpc.generate("router", inputs, stream=stream)
        return r.text, r.finish_reason

    steps = [
        ("gateway non-streamed", lambda: gateway_chat(a.gateway, a.key, a.model, False)),
        ("gateway streamed", lambda: gateway_chat(a.gateway, a.key, a.model, True)),
        ("triton grpc non-streamed", lambda: triton(False)),
        ("triton grpc streamed", lambda: triton(True)),
    ]
    kv_before = metric_sum(a.metrics, "disagg_kv_handoff_bytes_count")
    for name, call in steps:
        try:
            text, finish = call()
        except Exception as e:
            print(f"FAILED at step: {name}: {e}", file=sys.stderr)
            return 1
        if not text.strip() or finish not in ("stop", "length"):
            print(f"FAILED at step: {name}: reply {text!r}, finish {finish!r}", file=sys.stderr)
            return 1
        print(f"ok: {name}: {text.strip()[:60]!r} ({finish})")
    deadline = time.monotonic() + 10  # the models apply metric updates a moment later
    while True:
        handoffs = metric_sum(a.metrics, "disagg_kv_handoff_bytes_count") - kv_before
        if handoffs >= len(steps) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if handoffs < len(steps):
        print(
            f"FAILED at step: kv hand-off metric: {handoffs:.0f} hand-offs for {len(steps)} "
            "requests (disaggregated mode sends each through prefill)",
            file=sys.stderr,
        )
        return 1
    print(f"ok: kv hand-off metric: {handoffs:.0f} hand-offs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
