"""`disagg cluster` (what `make cluster` runs): every node its own `disagg serve --role` process;
the frontend answers; Ctrl-C (SIGINT) stops them all and leaves no tritonserver behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.triton_server import free_port_base, serve_env

from disagg import contracts as C
from disagg.client import HttpClient
from disagg.process import process_alive

pytestmark = pytest.mark.integration


def _servers_of(ancestor: int) -> list[int]:
    """The tritonserver processes descending from `ancestor`."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            is_server = b"bin/tritonserver" in (entry / "cmdline").read_bytes()
            if entry.name.isdigit() and is_server and _descends(int(entry.name), ancestor):
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def test_the_cluster_command_serves_and_stops_every_node_on_ctrl_c(tmp_path, engine_dir):
    base = free_port_base(47100, 130)
    env, ports = serve_env(engine_dir, tmp_path, decode_max_num_seqs=4)
    http = ports["http"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "disagg", "cluster", "--prefill", "1", "--decode", "1",
         "--base-port", str(base)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines = []
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops every server" in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        assert proc.poll() is None, "".join(lines)
        out = "".join(lines)
        assert "prefill-0" in out and "decode-0" in out and "frontend" in out
        r = HttpClient(f"http://127.0.0.1:{http}", timeout_s=60).generate(
            "orchestrator", {C.INPUT_IDS: [1, 2, 3], C.MAX_TOKENS: 4}
        )
        assert r.num_output_tokens == 4 and r.extra[C.SERVED_BY] == "disaggregated"
        servers = _servers_of(proc.pid)
        assert len(servers) == 3  # frontend, prefill, decode
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        deadline = time.monotonic() + 30
        while alive := [p for p in servers if process_alive(p)]:
            assert time.monotonic() < deadline, f"tritonserver processes left behind: {alive}"
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
