"""Bring a model back when one of its Python backend stub processes dies.

Triton 2.51 marks a dead stub "not healthy" and fails every later request to that model
instance; it does not start a new one, and the model still reports READY. The supervisor
counts each READY model's stub processes (children of tritonserver) and, when a model has had
fewer than it had when it became ready for two checks in a row, reloads it through the
repository API, which starts fresh stubs. A model an operator unloaded is not READY, so it is
left alone (and counted afresh once it is loaded again).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.request
from collections import Counter
from pathlib import Path

log = logging.getLogger("disagg.supervisor")
STUB = "triton_python_backend_stub"


def stub_models(server_pid: int) -> Counter:
    """Model name -> live stub processes of the tritonserver with `server_pid`."""
    counts: Counter = Counter()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) != server_pid or state in ("Z", "X"):
                continue
            args = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if len(args) > 1 and args[0].endswith(STUB.encode()):
            counts[Path(args[1].decode()).parent.parent.name] += 1  # <repo>/<model>/<v>/model.py
    return counts


class StubSupervisor:
    def __init__(
        self,
        server_pid: int,
        http_url: str,
        admin_header: str,
        admin_key: str,
        interval_s: float = 1.0,
    ) -> None:
        self.server_pid = server_pid
        self.http_url = http_url
        self.headers = {admin_header: admin_key}
        self.interval_s = interval_s
        self.expected: Counter = Counter()
        self.num_restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stub-supervisor", daemon=True)

    def start(self) -> StubSupervisor:
        self._short: Counter = Counter()  # checks in a row a model has been short of stubs
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except OSError as e:  # the server is going away, or busy: try again next time
                log.debug("supervisor check failed: %s", e)

    def check(self) -> None:
        live = stub_models(self.server_pid)
        ready = self._ready_models()
        for model in list(self.expected):
            if model not in ready:  # unloaded or loading: not ours to restart
                del self.expected[model]
                self._short.pop(model, None)
        for model in ready:
            if model not in self.expected:
                if live[model]:  # python-backend models only (ensembles have no stub)
                    self.expected[model] = live[model]
            elif live[model] < self.expected[model]:
                self._short[model] += 1
                if self._short[model] >= 2:
                    self._short.pop(model)
                    self._reload(model)
            else:
                self._short.pop(model, None)

    def _ready_models(self) -> set[str]:
        req = urllib.request.Request(
            f"{self.http_url}/v2/repository/index", data=b"{}", headers=self.headers, method="POST"
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return {m["name"] for m in json.loads(r.read()) if m.get("state") == "READY"}

    def _reload(self, model: str) -> None:
        """Unload, then load: a plain load of an unchanged, loaded model is a no-op."""
        log.warning("a stub of model %r died; restarting the model", model)
        try:
            self._repository(model, "unload")
            self._repository(model, "load")
            self.num_restarts += 1
            log.warning("model %r restarted", model)
        except OSError as e:
            log.error("restarting %r failed: %s", model, e)

    def _repository(self, model: str, action: str) -> None:
        req = urllib.request.Request(
            f"{self.http_url}/v2/repository/models/{model}/{action}",
            data=json.dumps({}).encode(),
            headers=self.headers,
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=300):
            pass
