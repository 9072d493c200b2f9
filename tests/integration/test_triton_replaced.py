"""A planned replacement of tritonserver (serve/recycle.py) under gateway load: `disagg serve`
with recycle_after_faults 1; a decode stub is killed while four clients stream greedy chat
completions through the official `openai` client. The supervisor reloads decode (the
streams are held and continued), the dead stub's region stays mapped in tritonserver, so
serve replaces the server: new requests are held, sent ones drained, a fresh tritonserver
started, the held ones released. Every request is counted: completed with the same greedy
text as before the fault, a clear error, or hung; none may be anything but completed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers.processes import OutputLines, child
from helpers.triton_server import serve_env

from disagg.serve.recycle import footprint
from disagg.serve.supervisor import stub_processes

pytestmark = pytest.mark.integration
PROMPTS = ["What is the capital of France?", "List three prime numbers.",
           "Say hello in French.", "Name a colour."]  # fmt: skip
HUNG_S = 180


def test_stubs_that_died_get_tritonserver_replaced_without_losing_a_request(engine_dir, tmp_path):
    import openai

    env, ports = serve_env(engine_dir, tmp_path, recycle_after_faults=1, decode_max_num_seqs=4)
    env.pop("DISAGG_API_KEYS", None)
    env.pop("DISAGG_ADMIN_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "disagg", "serve"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    out = OutputLines(proc)
    results: list[tuple[float, float, int, str]] = []  # (start, end, prompt, text or error)
    stop = threading.Event()
    try:
        out.wait("Ctrl-C to stop", 300)
        key = next(line for _, line in out.lines if "export DISAGG_API_KEY=" in line)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['gateway']}/v1",
                               api_key=key.split("=", 1)[1].strip(), max_retries=0,
                               timeout=HUNG_S)  # fmt: skip

        def loop(i: int) -> None:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    stream = client.chat.completions.create(
                        model="smollm2-135m-instruct", stream=True, max_tokens=24,
                        temperature=0, messages=[{"role": "user", "content": PROMPTS[i]}],
                    )  # fmt: skip
                    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                except openai.APITimeoutError as e:
                    text = f"hung: {e}"
                except openai.APIError as e:
                    text = f"error: {e}"
                results.append((t, time.monotonic(), i, text))

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        time.sleep(8)
        triton = child(proc.pid, "tritonserver")
        (decode,) = [pid for pid, (m, _) in stub_processes(triton).items() if m == "decode"]
        os.kill(decode, signal.SIGKILL)
        began, why = out.wait("replacing tritonserver", 60)
        assert "1 stubs died" in why, why
        done, line = out.wait("tritonserver replaced", 300)
        time.sleep(6)
        stop.set()
        for t in threads:
            t.join(HUNG_S + 10)
        new = child(proc.pid, "tritonserver")
        assert new != triton
        assert footprint(new).dead_regions == 0
        print(f"\n{line.strip()}; {len(results)} requests")
        bad = [r for r in results if r[3].startswith(("error", "hung"))]
        assert not bad, bad[:3]
        first = {}
        for _, _, i, text in sorted(results):
            first.setdefault(i, text)
            assert text == first[i], (PROMPTS[i], first[i], text)  # greedy, fault or not
        held = [r for r in results if began < r[0] < done]
        assert held, "no request arrived while the server was being replaced"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        stop.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
