#!/usr/bin/env python3
"""Ask the served model over HTTP (generate / generate_stream) or gRPC (streaming), print the
reply as it arrives, then its TTFT and decode speed.

    python client/disagg_client.py --chat "Tell me a joke."
    python client/disagg_client.py --protocol grpc --max-tokens 64 "Once upon a time"
    python client/disagg_client.py --model router --latency-sla-ms 150 --chat "Quick: 2+2?"
"""

from __future__ import annotations

import argparse
import sys

from disagg import contracts as C
from disagg.client import GenerateError, GrpcClient, HttpClient


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("prompt")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--url", help="default: http://127.0.0.1:8000 (http), 127.0.0.1:8001 (grpc)")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--latency-sla-ms", type=float, help="routing hint (model router)")
    p.add_argument("--task-type", help="routing hint (model router), e.g. batch_offline")
    a = p.parse_args(argv)
    inputs = {
        C.TEXT_INPUT: a.prompt,
        C.MAX_TOKENS: a.max_tokens,
        C.TEMPERATURE: a.temperature,
        C.TOP_P: a.top_p,
        C.APPLY_CHAT_TEMPLATE: a.chat,
        C.EXCLUDE_INPUT_IN_OUTPUT: True,
    }
    if a.seed is not None:
        inputs[C.SEED] = a.seed
    if a.latency_sla_ms is not None:
        inputs[C.LATENCY_SLA_MS] = a.latency_sla_ms
    if a.task_type:
        inputs[C.TASK_TYPE] = a.task_type
    stream = not a.no_stream
    show = (lambda d: print(d, end="", flush=True)) if stream else None
    try:
        if a.protocol == "http":
            result = HttpClient(a.url or "http://127.0.0.1:8000").generate(
                a.model, inputs, stream=stream, on_delta=show
            )
        else:
            result = GrpcClient(a.url or "127.0.0.1:8001").generate(
                a.model, inputs, stream=stream, on_delta=show
            )
    except (GenerateError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not stream:
        print(result.text, end="")
    print(
        f"\n[{result.finish_reason}; {result.num_input_tokens} prompt + "
        f"{result.num_output_tokens} output tokens; TTFT {result.ttft_s * 1000:.0f} ms; "
        f"{result.tokens_per_s:.1f} tok/s]",
        file=sys.stderr,
    )
    if result.extra.get(C.ROUTE_TARGET):
        print(
            f"[routed to {result.extra[C.ROUTE_TARGET]} ({result.extra.get(C.ROUTE_REASON)}), "
            f"served by {result.extra.get(C.SERVED_BY)}]",
            file=sys.stderr,
        )
    if result.extra.get(C.ERROR):
        print(f"[error: {result.extra[C.ERROR]}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
