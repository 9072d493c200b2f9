"""The gateway's watch on the router process of each request (gateway/backend.py `_watched`):
Triton 2.51 never ends the requests of a stub that died, so the gateway ends them itself
when the process its acknowledgement named is gone, or when no acknowledgement comes.
Real processes and asyncio; no Triton."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from disagg.gateway import backend
from disagg.gateway.backend import _watched, is_local, watchable
from disagg.gateway.errors import APIError

pytestmark = pytest.mark.unit


async def first_then_silence():
    yield "ack"
    await asyncio.sleep(3600)  # a dead stub's request: nothing more, ever
    yield "never"


async def drain(pid: list[int]) -> list[str]:
    got = []
    async for item in _watched(first_then_silence(), pid):
        got.append(item)
    return got


def test_a_request_whose_router_process_dies_ends_with_a_503():
    proc = subprocess.Popen(["sleep", "60"])
    pid = [proc.pid]  # (watchable() is the caller's check: any live pid is watched here)

    async def run() -> tuple[APIError, float]:
        task = asyncio.ensure_future(drain(pid))
        await asyncio.sleep(1.0)
        assert not task.done()  # alive: it waits
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        with pytest.raises(APIError) as err:
            await task
        return err.value, time.monotonic() - killed

    error, after = asyncio.run(run())
    assert error.status == 503 and f"router process ({proc.pid})" in error.message
    assert after < 2.0  # one WATCH_S or two


def test_no_acknowledgement_in_time_ends_it_too(monkeypatch):
    monkeypatch.setattr(backend, "ACK_S", 0.3)

    async def silent():
        await asyncio.sleep(3600)
        yield "never"

    async def run() -> None:
        async for _ in _watched(silent(), [0]):
            pass

    with pytest.raises(APIError, match="did not take the request"):
        asyncio.run(run())


def test_a_stream_that_ends_is_passed_through_whole():
    async def three():
        for x in ("ack", "a", "b"):
            yield x

    async def run() -> list[str]:
        return [x async for x in _watched(three(), [0])]

    assert asyncio.run(run()) == ["ack", "a", "b"]


def test_a_stream_that_answered_is_not_ended_for_want_of_an_acknowledgement(monkeypatch):
    """A model that does not acknowledge (another version, an ensemble) is not cut off after
    ACK_S: the rule holds only until something comes back."""
    monkeypatch.setattr(backend, "ACK_S", 0.3)
    monkeypatch.setattr(backend, "WATCH_S", 0.1)

    async def slow():
        yield "a"
        await asyncio.sleep(1.0)  # long past ACK_S, nothing acknowledged
        yield "b"

    async def run() -> list[str]:
        return [x async for x in _watched(slow(), [0])]

    assert asyncio.run(run()) == ["a", "b"]


def test_only_a_stub_this_process_can_see_is_watched():
    """A pid from another pid namespace (Triton in a container) names nothing here, or
    another process: not watched, never a false 503."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert not watchable(proc.pid)  # alive, but no Python backend stub
    finally:
        proc.kill()
        proc.wait()
    assert not watchable(2**22 + 12345)  # past pid_max: no such process


def test_only_a_triton_on_this_host_is_watched():
    assert is_local("127.0.0.1:8001") and is_local("localhost:8001")
    assert not is_local("192.0.2.1:8001")  # TEST-NET-1: no host has it


@pytest.mark.parametrize(
    "message, status",
    [
        ("Stub process 'router_0_0' is not healthy.", 503),  # died a moment ago: refused
        ("Request for unknown model: 'router' has no available versions", 503),
        ("Request for unknown model: 'router' is not ready", 503),
        ("something broke in a model", 500),
    ],
)
def test_a_model_whose_process_died_or_reloads_is_a_503_not_a_500(message, status):
    from disagg.gateway.backend import api_error

    e = api_error(message)
    assert e.status == status and message.rstrip(".") in str(e.message)
