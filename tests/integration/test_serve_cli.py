"""`make serve`'s command as a user runs it: banner, a request, Ctrl-C, clean exit."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers.processes import child
from helpers.triton_server import serve_env

from disagg import contracts as C
from disagg.serve.supervisor import stub_processes

pytestmark = pytest.mark.integration


def test_serve_prints_endpoints_answers_and_stops_on_ctrl_c(engine_dir, tmp_path):
    env, ports = serve_env(
        engine_dir, tmp_path, decode_max_num_seqs=2, recover_timeout_s=RECOVER_S,
        stub_frozen_s=RECOVER_S,
    )  # fmt: skip
    http, grpc, gateway = ports["http"], ports["grpc"], ports["gateway"]
    env.pop("DISAGG_ADMIN_KEY", None)
    env.pop("DISAGG_API_KEYS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "disagg", "serve"],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines: list[str] = []
    output = _lines_of(proc)
    try:
        deadline = time.monotonic() + 240
        _read_until(proc, output, lines, "Ctrl-C to stop", deadline)
        banner = "".join(lines)
        assert f"http://127.0.0.1:{http}" in banner and f"127.0.0.1:{grpc}" in banner
        assert "curl" in banner and "admin-key: " in banner
        # mode auto on one machine: conditional (the cost model picks per request)
        assert re.search(r"mode\s+conditional \(prefill and decode would share", banner), banner
        # ...so prefill yields decode's cores (prefill_yield.py): every thread at nice 10
        assert re.search(r"prefill\s+1 torch thread at nice 10", banner), banner
        stubs = stub_processes(child(proc.pid, "tritonserver"))
        nice = {m: {os.getpriority(os.PRIO_PROCESS, p) for p, (m2, _) in stubs.items() if m2 == m}
                for m in ("prefill", "decode")}  # fmt: skip
        assert nice == {"prefill": {10}, "decode": {0}}, nice
        body = json.dumps({C.TEXT_INPUT: "Hi", C.APPLY_CHAT_TEMPLATE: True, C.MAX_TOKENS: 4})
        req = urllib.request.Request(
            f"http://127.0.0.1:{http}/v2/models/ensemble/generate", data=body.encode()
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())[C.NUM_OUTPUT_TOKENS] > 0
        # the OpenAI API, with the one key serve made and showed once
        key = re.search(r"export DISAGG_API_KEY=(\S+)", banner).group(1)
        assert f"http://127.0.0.1:{gateway}/v1" in banner
        kept = (tmp_path / "gateway_keys").read_text()
        assert key not in kept and kept.startswith("sha256:")
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key=key)
        _says_hi(client)

        # tritonserver dies (as 2.51's Python backend can under load): a request meanwhile
        # gets a 503 "unavailable" once the gateway's retry window (gateway/backend.py
        # RETRY_S, 5 s) passes, or is served if Triton is back within it (a fast machine
        # restarts it in about that time); never a hang or another error. Serve keeps the
        # crash log and brings Triton back
        triton = child(proc.pid, "tritonserver")
        os.kill(triton, signal.SIGKILL)
        try:
            during = openai.OpenAI(
                base_url=f"http://127.0.0.1:{gateway}/v1", api_key=key, max_retries=0,
                timeout=60,
            ).chat.completions.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
            )  # fmt: skip
            assert during.usage.completion_tokens > 0
        except openai.APIStatusError as e:
            assert e.status_code == 503 and e.body["code"] == "unavailable"
        _read_until(proc, output, lines, "tritonserver is back", deadline + 240)
        assert list(tmp_path.glob("tritonserver.crash-*.log"))
        assert child(proc.pid, "tritonserver") != triton
        _says_hi(client)

        # decode's stub dies and its replacement hangs in its start (seen once in nine
        # kills): the model stays LOADING, /ready says so, and within the recovery time the
        # server is restarted; then everything serves again
        triton = child(proc.pid, "tritonserver")
        wedged_at = _wedge_decode_reload(triton)
        ready = f"http://127.0.0.1:{gateway}/ready"
        time.sleep(2)
        assert _status(ready) == 503
        new = _read_until(proc, output, lines, "tritonserver is back", wedged_at + RECOVER_S + 120)
        assert any("restarting the server" in line for line in new), "".join(lines)
        assert child(proc.pid, "tritonserver") != triton
        assert _status(ready) == 200
        _says_hi(client)
        # a stub alive but running no Python (python_backend's BLS deadlock leaves the router
        # so: docs/reliability.md): its heartbeat stands still, and the server is restarted
        triton = child(proc.pid, "tritonserver")
        (router,) = _stubs(triton, "router")
        os.kill(router, signal.SIGSTOP)
        frozen_at = time.monotonic()
        new = _read_until(proc, output, lines, "tritonserver is back", frozen_at + RECOVER_S + 120)
        assert any("has run no Python" in line for line in new), "".join(lines)
        assert time.monotonic() - frozen_at > RECOVER_S  # not before its time
        assert child(proc.pid, "tritonserver") != triton
        _says_hi(client)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    out = "".join(lines + _drained(output))
    assert proc.returncode == 0, out
    assert "stopping" in out
    for url in (f"http://127.0.0.1:{http}/v2/health/live", f"http://127.0.0.1:{gateway}/health"):
        with pytest.raises(OSError):  # nothing listens any more
            urllib.request.urlopen(url, timeout=2)


RECOVER_S = 15  # the serve process's recover_timeout_s here (60 by default)


def _lines_of(proc) -> queue.Queue[str | None]:
    """The serve process's output lines, read by a thread of their own (None at its end), so
    that a wait for a line can end at its deadline when the process prints nothing."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _drained(output: queue.Queue[str | None], wait_s: float = 10.0) -> list[str]:
    """What is left of the output once the process has ended."""
    left, deadline = [], time.monotonic() + wait_s
    while (line := output.get(timeout=max(deadline - time.monotonic(), 0.01))) is not None:
        left.append(line)
    return left


def _read_until(
    proc, output: queue.Queue[str | None], lines: list[str], text: str, deadline: float
) -> list[str]:
    """Moves the serve process's output into `lines` until a line holding `text` (by
    `deadline`, the process alive); returns the lines read."""
    start = len(lines)
    while not any(text in line for line in lines[start:]):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        with contextlib.suppress(queue.Empty):
            if (line := output.get(timeout=1.0)) is not None:
                lines.append(line)
    return lines[start:]


def _says_hi(client) -> None:
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert reply.usage.completion_tokens > 0


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _stubs(server: int, model: str) -> set[int]:
    return {pid for pid, (m, _) in stub_processes(server).items() if m == model}


def _wedge_decode_reload(server: int) -> float:
    """Kill decode's stub and stop (SIGSTOP) the one the supervisor starts in its place
    before it is up. Returns when that happened."""
    old = _stubs(server, "decode")
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = _stubs(server, "decode") - old
        if new:
            for pid in new:
                os.kill(pid, signal.SIGSTOP)
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError("the supervisor started no new decode stub")
