"""A frontend, one prefill and one decode server as separate tritonserver processes, for the
cluster fault tests: started with an internal token of the tests' own, and the three-prompt
round each fault test counts (completed / clear error / hung)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from disagg import contracts as C
from disagg.client import GenerateError, HttpClient
from disagg.serve.server import TritonServer
from helpers.triton_server import ready_or_once_more, server_settings, servers_under_token

PROMPTS = ["What is the capital of France?", "List three prime numbers.", "Say hello in French."]
HUNG_S = 90


@contextlib.contextmanager
def kv_cluster(engine_dir, tmp, token: str, **prefill_overrides: Any) -> Iterator[dict]:
    """{"prefill", "decode", "frontend": TritonServer, "front_settings": the frontend's}."""
    with servers_under_token(token) as servers:
        prefill = server_settings(engine_dir, tmp / "prefill", role="prefill", **prefill_overrides)
        servers["prefill"] = TritonServer(prefill, admin_key="k").start()
        servers["decode"] = TritonServer(
            server_settings(engine_dir, tmp / "decode", role="decode"), admin_key="k"
        ).start()
        for server in (servers["prefill"], servers["decode"]):
            ready_or_once_more(server)
        front = server_settings(
            engine_dir, tmp / "frontend", role="frontend",
            prefill_replicas=servers["prefill"].endpoints.grpc,
            decode_replicas=servers["decode"].endpoints.grpc,
        )  # fmt: skip
        servers["frontend"] = TritonServer(front, admin_key="k").start()
        ready_or_once_more(servers["frontend"])
        servers["front_settings"] = front
        yield servers


def generate(servers: dict, prompt: str):
    client = HttpClient(servers["frontend"].endpoints.http, timeout_s=HUNG_S)
    body = {C.TEXT_INPUT: prompt, C.APPLY_CHAT_TEMPLATE: True, C.MAX_TOKENS: 24,
            C.EXCLUDE_INPUT_IN_OUTPUT: True}  # fmt: skip
    return client.generate("router", body)


def run_all(servers: dict) -> tuple[dict[str, int], dict[str, object], dict[str, float]]:
    """PROMPTS at once through the frontend: (counts, what each got, seconds each took)."""
    got: dict[str, object] = {}
    took: dict[str, float] = {}

    def run(i: int) -> None:
        t = time.monotonic()
        try:
            got[f"r{i}"] = generate(servers, PROMPTS[i])
        except GenerateError as e:
            got[f"r{i}"] = e
        took[f"r{i}"] = time.monotonic() - t

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HUNG_S)
    counts = {"completed": 0, "error": 0, "hung": 0}
    for i in range(len(PROMPTS)):
        r = got.get(f"r{i}")
        counts["hung" if r is None else "error" if isinstance(r, Exception) else "completed"] += 1
    return counts, got, took


def assert_greedy(got: dict[str, object], refs: list[str], served_by: str) -> None:
    """Every reply equal to its greedy reference, served the way the fault should leave."""
    for i, ref in enumerate(refs):
        r: Any = got[f"r{i}"]
        assert r.text == ref and r.extra[C.SERVED_BY] == served_by, (i, r)
