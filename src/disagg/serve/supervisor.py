"""Bring a model back when one of its Python backend stub processes dies.

Triton 2.51 marks a dead stub "not healthy" and fails every later request to that model
instance; it does not start a new one, and the model still reports READY. The supervisor
counts each READY model's stub processes (children of tritonserver) against the instances
its config asks for and, when a model has fewer than at the last check (a stub died) or has
had fewer than asked for two checks in a row, reloads it through the repository API, which
starts fresh stubs. A model an operator unloaded is not
READY, so it is left alone (and counted afresh once it is loaded again).

A reload can wedge: seen once in nine decode kills, the new stub hung in its start and the
model stayed LOADING for good, with the load call and any later unload hanging too. So a
reload runs on a thread of its own and has `recover_timeout_s` to bring the model back
READY with all its stubs; past that the supervisor gives up on the model and calls
`on_wedged`, which restarts the whole server (TritonServer kills it; `disagg serve` starts
it again). Meanwhile the server is not ready (strict readiness), and so neither is the
gateway's /ready.

A stub can also stop without dying: python_backend's decoupled BLS can deadlock one for good
(docs/reliability.md, "A stub whose Python stops"). Each model's stub touches a heartbeat
file from a Python thread (disagg/heartbeat.py); one whose file has not changed for
`frozen_after_s` of this supervisor's own watching is wedged, and the server is restarted as
above (a stub caught in that deadlock leaves tritonserver's threads waiting on it, so
restarting the model alone would not do).

Each replaced stub is reaped by tritonserver itself; the shared memory region it leaves in
/dev/shm is removed once the stub is gone (`remove_stale_regions`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from disagg import heartbeat
from disagg.process import stat_fields, stub_args

log = logging.getLogger("disagg.supervisor")
SHM_PREFIX = "triton_python_backend_shm_region_"


def stub_processes(server_pid: int) -> dict[int, tuple[str, str]]:
    """pid -> (model name, shared memory region) of each live stub of the server
    `server_pid` (zombies and processes on their way out excluded)."""
    stubs = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = stat_fields(int(entry.name))[:2]
            if int(ppid) != server_pid or state in ("Z", "X"):
                continue
        except (OSError, ValueError):
            continue
        if (args := stub_args(int(entry.name))) is not None:
            model = Path(args[1].decode()).parent.parent.name  # <repo>/<model>/<v>/model.py
            stubs[int(entry.name)] = (model, args[2].decode())
    return stubs


def _state(pid: int) -> str:
    """A process's state letter (R, S, T when SIGSTOPped, t when a debugger holds it), or
    "" when it cannot be read."""
    try:
        return stat_fields(pid)[0]
    except (OSError, IndexError):
        return ""


class ExitWatch:
    """Wakes the supervisor the moment a stub it has seen exits, rather than at its next
    check: a pidfd (Linux 5.3+) of each stub, readable once that process has ended. Where
    pidfds are missing, `wait` just sleeps out its timeout, as the checks did before."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self.usable = hasattr(os, "pidfd_open")
        self._wake_r, self._wake_w = os.pipe()  # stop() ends a wait at once too
        self._lock = threading.Lock()

    def follow(self, pids: set[int]) -> None:
        for pid in set(self._fds) - pids:
            os.close(self._fds.pop(pid))
        for pid in pids - set(self._fds):
            if not self.usable:
                return
            try:
                self._fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                continue  # gone already: the next check sees it
            except OSError:  # (ENOSYS: a kernel without pidfds)
                self.usable = False

    def wait(self, timeout_s: float) -> None:
        # poll, not select: a process with many sockets (bench, topology) may hand out
        # descriptors past select's 1024
        poller = select.poll()
        for fd in (self._wake_r, *self._fds.values()):
            poller.register(fd, select.POLLIN)
        poller.poll(timeout_s * 1000)

    def wake(self) -> None:
        with self._lock:
            if self._wake_w >= 0:
                os.write(self._wake_w, b"x")

    def close(self) -> None:
        self.follow(set())
        with self._lock:  # (never a write to a descriptor number reused meanwhile)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1


def remove_stale_regions(server_pid: int, known: set[str], shm_dir: str = "/dev/shm") -> set[str]:
    """Remove the shared memory regions in `known` whose stub is gone; returns the regions
    of the live stubs (the next call's `known`). A killed stub's 64 MiB region otherwise
    stays on disk until the server exits."""
    live = {region for _, region in stub_processes(server_pid).values()}
    for region in known - live:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(shm_dir, region))
            log.info("removed the shared memory of a stub that died: %s", region)
    return live


class StubSupervisor:
    def __init__(
        self,
        server_pid: int,
        http_url: str,
        admin_header: str,
        admin_key: str,
        interval_s: float = 1.0,
        recover_timeout_s: float = 60.0,
        on_wedged: Callable[[str], None] | None = None,
        heartbeat_dir: str | Path | None = None,
        frozen_after_s: float = 20.0,
    ) -> None:
        self.server_pid = server_pid
        self.http_url = http_url
        self.headers = {admin_header: admin_key}
        self.interval_s = interval_s
        self.recover_timeout_s = recover_timeout_s
        self.on_wedged = on_wedged
        self.heartbeat_dir = None if heartbeat_dir is None else Path(heartbeat_dir)
        self.frozen_after_s = frozen_after_s
        self._beats: dict[int, tuple[int, float]] = {}  # pid -> (file mtime, s watched still)
        self._last_check: float | None = None
        # READY python models -> stubs their config asks for
        self.expected: Counter[str] = Counter()
        self.recovering: dict[str, float] = {}  # model -> monotonic deadline of its reload
        self.num_restarts = 0
        self.wedged: str | None = None  # the model whose reload did not finish in time
        self._short: Counter[str] = Counter()  # checks in a row a model has been short of stubs
        self._last_live: Counter[str] = Counter()  # each model's stubs at the last check
        self._last_pids: set[int] = set()
        self._regions: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stub-supervisor", daemon=True)

    def start(self) -> StubSupervisor:
        self._exits = ExitWatch()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._exits.wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _shm_loop(self) -> None:
        """On a thread of its own: the scan must have seen a stub alive to clean up after
        it, and check()'s HTTP calls can wait for seconds while Triton loads a model."""
        while not self._stop.wait(self.interval_s / 2):
            try:
                self._regions = remove_stale_regions(self.server_pid, self._regions)
            except OSError as e:
                log.debug("shared memory cleanup failed: %s", e)

    def _loop(self) -> None:
        threading.Thread(target=self._shm_loop, name="stub-shm", daemon=True).start()
        exits = self._exits
        try:
            while not self._stop.is_set():
                try:
                    self.check()
                except (OSError, ValueError) as e:  # the server is going away, or busy
                    log.debug("supervisor check failed: %s", e)
                except Exception:  # never let the supervisor thread die
                    log.exception("supervisor check failed")
                try:
                    exits.follow(self._last_pids)
                    exits.wait(self.interval_s)  # a stub's exit ends it at once
                except Exception:
                    log.exception("supervisor exit watch failed: checking every interval")
                    self._stop.wait(self.interval_s)
        finally:
            exits.close()

    def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        stubs = stub_processes(self.server_pid)
        self._last_pids = set(stubs)
        live = Counter(model for model, _ in stubs.values())
        dropped = {m for m in live | self._last_live if live[m] < self._last_live[m]}
        self._last_live = live
        self._check_recovering(live, now)
        if self.wedged is not None:
            return
        if self._frozen_stub(stubs, now):
            return
        ready = self._ready_models()
        for model in list(self.expected):
            if model not in ready and model not in self.recovering:  # an operator's unload
                del self.expected[model]
                self._short.pop(model, None)
        for model in ready:
            if model in self.recovering:
                continue
            if model not in self.expected:
                wanted = self._instances(model)
                if wanted:  # python-backend models only (ensembles have no stub)
                    self.expected[model] = wanted
                continue
            if live[model] < self.expected[model]:
                self._short[model] += 1
                # one short check may be a load in progress; a stub gone since the last check
                # is a death: restart at once (requests wait for it: pipeline/recovery.py)
                if self._short[model] >= 2 or model in dropped:
                    self._short.pop(model)
                    self.recovering[model] = now + self.recover_timeout_s
                    self._start_reload(model)
            else:
                self._short.pop(model, None)

    def _check_recovering(self, live: Counter[str], now: float) -> None:
        for model, deadline in list(self.recovering.items()):
            if live[model] >= self.expected[model] and model in self._ready_models():
                del self.recovering[model]
                self.num_restarts += 1
                log.warning("model %r restarted", model)
            elif now > deadline and self.wedged is None:
                self.wedged = model
                log.error(
                    "model %r not back %.0f s after its restart began; restarting the server",
                    model, self.recover_timeout_s,
                )  # fmt: skip
                if self.on_wedged is not None:
                    self.on_wedged(model)

    def _frozen_stub(self, stubs: dict[int, tuple[str, str]], now: float) -> bool:
        """Whether a stub's heartbeat stood still for frozen_after_s of watching (then the
        server is restarted; 0: never). Only stubs that have beaten once are judged (one
        still loading, a model without a heartbeat or one being reloaded is not), and only
        time this supervisor watched a running server counts: a gap between checks counts
        at most three intervals (this process was stopped, or a check took long), and none
        counts while tritonserver itself or the stub is stopped by a debugger (a hung node
        frozen whole is the cluster's to handle; a stub SIGSTOPped alone is judged)."""
        if self.heartbeat_dir is None or self.frozen_after_s <= 0:
            return False
        step = 0.0 if self._last_check is None else min(now - self._last_check, 3 * self.interval_s)
        self._last_check = now
        if _state(self.server_pid) in ("T", "t"):
            step = 0.0
        beats = {}
        for pid, (model, _) in stubs.items():
            try:
                mtime = os.stat(heartbeat.path_of(self.heartbeat_dir, pid)).st_mtime_ns
            except OSError:
                continue
            seen, still = self._beats.get(pid, (mtime, 0.0))
            watched = step if model not in self.recovering and _state(pid) != "t" else 0.0
            beats[pid] = (mtime, still + watched if mtime == seen else 0.0)
            if beats[pid][1] > self.frozen_after_s:
                self.wedged = model
                log.error(
                    "a stub of model %r (pid %d) has run no Python for %.0f s (frozen or "
                    "deadlocked); restarting the server", model, pid, beats[pid][1],
                )  # fmt: skip
                if self.on_wedged is not None:
                    self.on_wedged(model)
                return True
        for pid in set(self._beats) - set(stubs):  # gone: its pid may come back to another
            with contextlib.suppress(OSError):
                heartbeat.path_of(self.heartbeat_dir, pid).unlink()
        self._beats = beats
        return False

    def _start_reload(self, model: str) -> None:
        log.warning("a stub of model %r died; restarting the model", model)
        threading.Thread(
            target=self._reload, args=(model,), name=f"reload-{model}", daemon=True
        ).start()

    def _reload(self, model: str) -> None:
        """Unload, then load (a plain load of an unchanged, loaded model is a no-op), each call
        bounded by what is left of the model's recovery time."""
        try:
            for action in ("unload", "load"):
                left = self.recovering.get(model, 0.0) - time.monotonic()
                if left <= 0:
                    return
                self._repository(model, action, timeout_s=left)
        except OSError as e:  # the deadline check in check() decides what follows
            log.error("restarting %r failed: %s", model, e)

    def _instances(self, model: str) -> int:
        """How many stubs a model's config asks for: 0 for models without any."""
        with urllib.request.urlopen(
            f"{self.http_url}/v2/models/{model}/config", timeout=10
        ) as r:  # fmt: skip
            config = json.loads(r.read())
        if config.get("backend") != "python":
            return 0
        return sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1

    def _ready_models(self) -> set[str]:
        req = urllib.request.Request(
            f"{self.http_url}/v2/repository/index", data=b"{}", headers=self.headers, method="POST"
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return {m["name"] for m in json.loads(r.read()) if m.get("state") == "READY"}

    def _repository(self, model: str, action: str, timeout_s: float) -> None:
        req = urllib.request.Request(
            f"{self.http_url}/v2/repository/models/{model}/{action}",
            data=json.dumps({}).encode(),
            headers=self.headers,
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=timeout_s):
            pass
