"""KV payloads over TCP on loopback: a real KVServer and real sockets; leases freed on pull,
drop and expiry; a wrong token, a missing handle, a cut-off or corrupted transfer refused."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from disagg import kvnet
from disagg.engine.config import ModelArgs
from disagg.engine.kv_payload import KVPayload
from disagg.errors import KVPayloadError
from disagg.kvnet import KVLeases, KVRef, KVServer, drop, pull

pytestmark = pytest.mark.unit
TOKEN = "internal-token"
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=100)


def payload(tokens: int = 7) -> np.ndarray:
    shape = (ARGS.n_layers, ARGS.n_kv_heads, tokens, ARGS.head_dim)
    g = np.random.default_rng(tokens)
    k, v = (g.standard_normal(shape, dtype=np.float32) for _ in range(2))
    return KVPayload.from_arrays(ARGS, k, v).pack()


@pytest.fixture(autouse=True)
def fresh_unreachable(monkeypatch):
    """No test's failed connect makes another's address unreachable."""
    monkeypatch.setattr(kvnet, "UNREACHABLE", kvnet.Unreachable())


@pytest.fixture
def server():
    srv = KVServer(KVLeases(capacity_bytes=1 << 20, ttl_s=30), TOKEN).start()
    yield srv
    srv.close()


def ref_for(server, data) -> KVRef:
    return KVRef(server.address(), server.leases.put(data), data.nbytes)


def test_a_pulled_payload_is_the_same_bytes_and_its_lease_is_freed(server):
    data = payload()
    ref = KVRef.parse(ref_for(server, data).to_bytes())  # as it travels through the frontend
    got = pull(ref, TOKEN)
    assert bytes(got) == bytes(data)
    KVPayload.from_bytes(got).check_compatible(ARGS)  # verified like any payload
    assert len(server.leases) == 0 and server.leases.held_bytes == 0
    with pytest.raises(KVPayloadError, match="not held"):  # one pull per lease
        pull(ref, TOKEN)


def test_the_lease_copies_the_buffer_its_caller_reuses(server):
    data = payload()
    ref = ref_for(server, data)
    expected = bytes(data)
    data[:] = 0  # prefill reuses its buffer for the next request
    assert bytes(pull(ref, TOKEN)) == expected


def test_a_wrong_token_is_refused_and_the_lease_kept(server):
    ref = ref_for(server, payload())
    with pytest.raises(KVPayloadError, match="refused"):
        pull(ref, "not-the-token")
    assert len(server.leases) == 1


def test_drop_and_expiry_free_leases(server):
    ref = ref_for(server, payload())
    assert drop(ref, TOKEN) and len(server.leases) == 0
    assert not drop(ref, TOKEN)  # already gone
    ref_for(server, payload())
    assert server.leases.expire(now=time.monotonic() + 31) == 1
    assert server.leases.held_bytes == 0 and server.leases.expired == 1


def test_capacity_is_bounded(server):
    big = np.zeros(700_000, np.uint8)
    server.leases.put(big)
    with pytest.raises(KVPayloadError, match="capacity full"):
        server.leases.put(big)


def test_an_unreachable_server_and_a_bad_reference_fail_clearly():
    (port,) = [s.getsockname()[1] for s in [socket.create_server(("127.0.0.1", 0))]]
    with pytest.raises(KVPayloadError, match="unreachable"):
        pull(KVRef(f"127.0.0.1:{port}", "ab" * 16, 10), TOKEN, timeout_s=2)
    with pytest.raises(KVPayloadError, match="unreadable"):
        KVRef.parse(b"DKVREF1{not json")
    assert KVRef.parse(payload()) is None  # a payload itself, not a reference


def test_a_transfer_cut_off_midway_never_passes_as_a_payload():
    """A fake server that sends half the bytes, then closes: pull raises."""
    data = payload()
    listener = socket.create_server(("127.0.0.1", 0))

    def half():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(bytes([0]) + data.nbytes.to_bytes(8, "little"))
            conn.sendall(bytes(data[: data.nbytes // 2]))

    threading.Thread(target=half, daemon=True).start()
    ref = KVRef(f"127.0.0.1:{listener.getsockname()[1]}", "cd" * 16, data.nbytes)
    with pytest.raises(KVPayloadError, match="cut off"):
        pull(ref, TOKEN)
    listener.close()


def test_corrupted_bytes_fail_the_crc_check(server):
    data = payload()
    data[-3] ^= 0xFF  # corrupted after the CRC was computed (on the wire, say)
    got = pull(ref_for(server, data), TOKEN)
    with pytest.raises(KVPayloadError, match="CRC"):
        KVPayload.from_bytes(got)


def test_a_transfer_that_stalls_fails_in_seconds_not_at_its_deadline(monkeypatch):
    """A path lost mid-transfer (a partition) sends nothing more: the pull fails after
    STALL_TIMEOUT_S without bytes, not after its whole timeout_s."""
    monkeypatch.setattr(kvnet, "STALL_TIMEOUT_S", 0.5)
    data = payload()
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def stall():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(bytes([0]) + data.nbytes.to_bytes(8, "little"))
            conn.sendall(bytes(data[:100]))
            release.wait(30)

    threading.Thread(target=stall, daemon=True).start()
    ref = KVRef(f"127.0.0.1:{listener.getsockname()[1]}", "ef" * 16, data.nbytes)
    t = time.monotonic()
    with pytest.raises(KVPayloadError, match="timed out"):
        pull(ref, TOKEN, timeout_s=30)
    assert time.monotonic() - t < 5
    release.set()
    listener.close()


def test_an_address_that_refused_fails_at_once_until_its_hold_ends(monkeypatch):
    """After a failed connect, pulls from that address fail without trying for the hold;
    then it is tried again and a server that came back there serves (no restart needed)."""
    monkeypatch.setattr(kvnet, "UNREACHABLE", kvnet.Unreachable(hold_s=2.0))
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now: refused
    leases = KVLeases(capacity_bytes=1 << 20, ttl_s=30)
    data = payload()
    ref = KVRef(f"127.0.0.1:{port}", leases.put(data), data.nbytes)
    with pytest.raises(KVPayloadError, match="unreachable: "):
        pull(ref, TOKEN)
    srv = KVServer(leases, TOKEN, port=port).start()  # back, but within the hold
    try:
        with pytest.raises(KVPayloadError, match=r"unreachable \(connect: .* s ago\)"):
            pull(ref, TOKEN)
        assert len(leases) == 1  # not even asked
        time.sleep(2.1)
        assert bytes(pull(ref, TOKEN)) == bytes(data)
    finally:
        srv.close()
