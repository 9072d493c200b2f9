"""The planned restart's parts (serve/recycle.py, disagg/hold.py) on real processes, files and
sockets: the footprint of a process, when a restart is due, the hold, the drain."""

from __future__ import annotations

import asyncio
import mmap
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disagg.hold import Hold
from disagg.serve.recycle import Footprint, Recycler, drain, footprint
from disagg.serve.supervisor import SHM_PREFIX

pytestmark = pytest.mark.unit


def test_the_footprint_counts_threads_rss_and_regions_mapped_after_their_file_went(tmp_path):
    before = footprint(os.getpid())
    assert before.threads >= 1 and before.rss_mb > 1
    path = f"/dev/shm/{SHM_PREFIX}test_{os.getpid()}"
    with open(path, "w+b") as f:
        f.truncate(1 << 16)
        region = mmap.mmap(f.fileno(), 1 << 16)
    try:
        assert footprint(os.getpid()).dead_regions == before.dead_regions  # its file is there
        os.unlink(path)  # as the supervisor removes a dead stub's file
        assert footprint(os.getpid()).dead_regions == before.dead_regions + 1
        stop = threading.Event()
        t = threading.Thread(target=stop.wait)
        t.start()
        assert footprint(os.getpid()).threads == before.threads + 1
        stop.set()
        t.join()
    finally:
        region.close()
        if os.path.exists(path):
            os.unlink(path)


def test_a_restart_is_due_only_after_stubs_died():
    r = Recycler(after_faults=3, thread_growth=0.5)
    r.baseline = Footprint(100, 1000, 0)
    assert r.due(Footprint(100, 3000, 0)) is None  # without a dead stub, never
    assert r.due(Footprint(120, 1000, 2)) is None
    assert "3 stubs died" in r.due(Footprint(120, 1000, 3))
    assert "threads 100 -> 150" in r.due(Footprint(150, 1000, 1))
    off = Recycler(after_faults=0, thread_growth=0)
    off.baseline = Footprint(100, 1000, 0)
    assert off.due(Footprint(900, 1000, 50)) is None


def test_a_hold_holds_until_it_ends_or_its_deadline_passes(tmp_path):
    hold = Hold(tmp_path / "h")
    assert not hold.active()
    hold.begin(30)
    assert hold.active()

    async def waiter() -> tuple[bool, float]:
        t = time.monotonic()
        held = await hold.wait(poll_s=0.02)
        return held, time.monotonic() - t

    threading.Timer(0.3, hold.end).start()
    held, waited = asyncio.run(waiter())
    assert held and 0.25 < waited < 2
    assert asyncio.run(hold.wait()) is False  # nothing to wait for
    hold.begin(-1)  # a file a crash left, its deadline past: holds nothing
    assert not hold.active()
    (tmp_path / "h").write_text("garbage")
    assert not hold.active()


class _Gateway(BaseHTTPRequestHandler):
    busy: list[tuple[float, float]] = []  # (in flight, held) per scrape, the last one repeats

    def do_GET(self):  # noqa: N802 (http.server's name)
        inflight, held = self.busy.pop(0) if len(self.busy) > 1 else self.busy[0]
        body = (f"disagg_gateway_inflight_requests {inflight}\n"
                f"disagg_gateway_held_requests {held}\n").encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def test_the_drain_holds_new_requests_and_waits_for_the_ones_being_served(tmp_path, gateway):
    """Held requests wait before the gateway counts them in flight: only those count."""
    hold = Hold(tmp_path / "h")
    _Gateway.busy = [(3, 5), (1, 5), (0, 5)]
    t = time.monotonic()
    assert drain(hold, gateway, drain_s=10, hold_s=60) == 0
    assert hold.active() and time.monotonic() - t < 5


def test_the_drain_stops_waiting_at_its_limit_and_says_how_many_were_left(tmp_path, gateway):
    hold = Hold(tmp_path / "h")
    _Gateway.busy = [(2, 0)]
    t = time.monotonic()
    assert drain(hold, gateway, drain_s=0.5, hold_s=60) == 2
    assert 0.5 <= time.monotonic() - t < 3


def test_the_drain_ends_when_asked_to_stop(tmp_path, gateway):
    _Gateway.busy = [(2, 0)]
    t = time.monotonic()
    drain(Hold(tmp_path / "h"), gateway, drain_s=30, hold_s=60, stopped=lambda: True)
    assert time.monotonic() - t < 1


def test_an_unreadable_gateway_is_waited_for_a_while_then_taken_for_gone(tmp_path, monkeypatch):
    """A moment without an answer is not an empty gateway (its requests would be cut); one
    that stays unreadable went, and what it served with it."""
    import disagg.serve.recycle as R

    monkeypatch.setattr(R, "UNREADABLE_S", 0.6)
    t = time.monotonic()
    assert drain(Hold(tmp_path / "h"), "http://127.0.0.1:1/metrics", drain_s=30, hold_s=60) == 0
    assert 0.6 <= time.monotonic() - t < 5


def test_the_baseline_follows_the_servers_warm_up_until_a_stub_dies():
    r = Recycler(after_faults=3, thread_growth=0.5)
    r.baseline = Footprint(100, 1000, 0)
    assert r.due(Footprint(140, 1000, 0)) is None  # first requests start threads
    assert r.baseline.threads == 140
    assert r.due(Footprint(160, 1000, 1)) is None  # +14%, not +60% of the start
    assert r.due(Footprint(210, 1000, 1)) is not None


def test_the_settings_choose_the_triggers_and_a_server_without_its_gateway_has_none(tmp_path):
    from disagg.settings import ServeSettings

    s = ServeSettings(build_dir=str(tmp_path), recycle_after_faults=2)
    assert Recycler.for_settings(s).after_faults == 2
    off = Recycler.for_settings(ServeSettings(build_dir=str(tmp_path), gateway_enabled=False))
    assert (off.after_faults, off.thread_growth) == (0, 0.0)
    pool = ServeSettings(build_dir=str(tmp_path), gateway_enabled=False, role="decode")
    assert Recycler.for_settings(pool).after_faults == ServeSettings.recycle_after_faults


def test_check_measures_at_most_every_check_s(monkeypatch):
    import disagg.serve.recycle as R

    r = Recycler(after_faults=1, thread_growth=0)
    r.settle(os.getpid())
    seen = []
    monkeypatch.setattr(R, "footprint", lambda pid: seen.append(pid) or Footprint(1, 1, 1))
    assert r.check(os.getpid()) is None and seen == []  # not yet CHECK_S since it began
    r.next_check = 0.0
    assert "1 stubs died" in r.check(os.getpid()) and seen == [os.getpid()]
    assert r.check(os.getpid()) is None and len(seen) == 1
