"""Hand-offs within one server through shared-memory files (kvshm.py): the bytes decode maps
are the bytes prefill packed, each file is read once, and nothing outlives its budget, its
TTL, a dropped request or a reference that names something else."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from disagg import kvshm
from disagg.engine.kv_payload import KVPayload
from disagg.errors import KVPayloadError
from disagg.pipeline.handoff import kv_path, release
from disagg.pipeline.local import prefill_result

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not os.path.isdir(kvshm.SHM_DIR), reason="no /dev/shm on this host"),
]


def payload(tokens: int = 40, seed: int = 0) -> KVPayload:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((3, 2, tokens, 8), dtype=np.float32)
    return KVPayload("test-model", 3, 2, 8, tokens, k, -k)


@pytest.fixture
def shm():
    handoffs = kvshm.ShmHandoffs(capacity_bytes=1 << 20, ttl_s=30.0)
    yield handoffs
    handoffs.close()


def test_decode_maps_what_prefill_packed_and_the_file_is_read_once(shm):
    kv = payload()
    ref = shm.write(kv.packed_size(), kv.pack)
    assert ref is not None and os.path.exists(ref.path)
    assert oct(os.stat(ref.path).st_mode & 0o777) == "0o600"
    wire = np.frombuffer(ref.to_bytes(), np.uint8)
    assert wire.nbytes < 200 < kv.packed_size()  # the reference travels, not the bytes
    assert kv_path(wire) == ("shm", kv.packed_size())
    got = kvshm.ShmRef.parse(wire.data)
    assert got == ref
    data = kvshm.open_payload(got)
    assert not os.path.exists(ref.path)  # unlinked on open: its memory goes with the views
    result = prefill_result("r", 7, 1, data)
    np.testing.assert_array_equal(result.kv.k, kv.k)
    np.testing.assert_array_equal(result.kv.v, kv.v)
    with pytest.raises(KVPayloadError, match="gone"):
        kvshm.open_payload(got)  # a second reader (a replayed call) gets a clear error
    assert shm.held_bytes() == 0  # decode took it: no longer counted against the budget


def test_over_the_budget_or_past_the_ttl_the_payload_goes_inline_or_is_freed():
    kv = payload()
    shm = kvshm.ShmHandoffs(capacity_bytes=int(2.5 * kv.packed_size()), ttl_s=30.0)
    try:
        first = shm.write(kv.packed_size(), kv.pack)
        second = shm.write(kv.packed_size(), kv.pack)
        assert first and second and shm.write(kv.packed_size(), kv.pack) is None  # budget
        assert shm.drop(first) and not os.path.exists(first.path)
        third = shm.write(kv.packed_size(), kv.pack)
        assert third is not None  # the dropped one's bytes came back
        shm.ttl_s = 0.0  # nobody read them: the next write's sweep unlinks them
        time.sleep(0.01)
        assert shm.held_bytes() == 0
        assert not os.path.exists(second.path) and not os.path.exists(third.path)
    finally:
        shm.close()


def test_a_fill_that_fails_leaves_no_file(shm):
    before = set(os.listdir(kvshm.SHM_DIR))

    def broken(out):
        out[:10] = 1
        raise RuntimeError("packing failed")

    with pytest.raises(RuntimeError, match="packing failed"):
        shm.write(4096, broken)
    assert set(os.listdir(kvshm.SHM_DIR)) - before == set()
    assert shm.held_bytes() == 0


def test_release_frees_the_file_of_a_request_nobody_will_decode(shm):
    kv = payload()
    ref = shm.write(kv.packed_size(), kv.pack)
    assert release(np.frombuffer(ref.to_bytes(), np.uint8))
    assert not os.path.exists(ref.path)
    assert not release(np.frombuffer(ref.to_bytes(), np.uint8))  # already gone: no error


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "/dev/shm/../../etc/passwd",
        "/dev/shm/disagg-kv-not-hex",
        "/dev/shm/disagg-kv-" + "a" * 31,
        "/tmp/disagg-kv-" + "a" * 32,
    ],
)
def test_a_reference_naming_anything_else_is_refused(path):
    wire = kvshm.ShmRef(path, 10).to_bytes()
    with pytest.raises(KVPayloadError, match="malformed"):
        kvshm.ShmRef.parse(wire)


def test_unreadable_references_and_plain_payloads():
    with pytest.raises(KVPayloadError, match="unreadable"):
        kvshm.ShmRef.parse(kvshm.REF_MAGIC + b"{not json")
    assert kvshm.ShmRef.parse(payload().pack().data) is None  # a payload itself


def test_a_symlink_or_a_file_of_the_wrong_size_is_not_read(tmp_path):
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 10)
    link = kvshm.ShmRef(os.path.join(kvshm.SHM_DIR, "disagg-kv-" + os.urandom(16).hex()), 10)
    os.symlink(target, link.path)
    try:
        with pytest.raises(KVPayloadError, match="gone"):  # O_NOFOLLOW
            kvshm.open_payload(link)
    finally:
        os.unlink(link.path)
    short = kvshm.ShmRef(os.path.join(kvshm.SHM_DIR, "disagg-kv-" + os.urandom(16).hex()), 99)
    with open(short.path, "wb") as f:
        f.write(b"y" * 10)
    with pytest.raises(KVPayloadError, match="10 bytes"):
        kvshm.open_payload(short)
    assert not os.path.exists(short.path)


def test_the_profile_times_the_same_path_and_leaves_no_file():
    from disagg.engine.config import ModelArgs
    from disagg.planner import handoff

    before = {n for n in os.listdir(kvshm.SHM_DIR) if n.startswith("disagg-kv-")}
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=9)
    samples = handoff.measure(args, (16, 256), reps=2)
    sizes = [size for size, _ in samples["shm"]]
    assert sizes == [size for size, _ in samples["pack"]] and sizes[0] < sizes[1]
    assert all(seconds > 0 for _, seconds in samples["shm"])
    assert {n for n in os.listdir(kvshm.SHM_DIR) if n.startswith("disagg-kv-")} == before


def test_an_unread_file_goes_at_its_ttl_with_no_write_to_sweep_it():
    shm = kvshm.ShmHandoffs(capacity_bytes=1 << 20, ttl_s=0.2)  # swept every 0.1 s
    try:
        kv = payload()
        ref = shm.write(kv.packed_size(), kv.pack)
        deadline = time.monotonic() + 5
        while os.path.exists(ref.path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(ref.path)
    finally:
        shm.close()


def test_files_a_dead_process_left_are_removed_when_the_next_one_opens():
    stale = os.path.join(kvshm.SHM_DIR, "disagg-kv-" + os.urandom(16).hex())
    fresh = os.path.join(kvshm.SHM_DIR, "disagg-kv-" + os.urandom(16).hex())
    for path in (stale, fresh):
        with open(path, "wb") as f:
            f.write(b"k" * 64)
    old = time.time() - 120
    os.utime(stale, (old, old))
    shm = kvshm.ShmHandoffs.open(capacity_bytes=1 << 20, ttl_s=60.0)
    try:
        assert shm is not None
        assert not os.path.exists(stale) and os.path.exists(fresh)  # another's, in flight
    finally:
        os.unlink(fresh)
        shm.close()


def test_it_leaves_room_in_dev_shm_for_tritons_own_shared_memory(shm):
    st = os.statvfs(kvshm.SHM_DIR)
    free = st.f_bavail * st.f_frsize
    shm.capacity_bytes = 1 << 50
    assert shm.write(free - (1 << 20), lambda out: None) is None  # not even allocated
    assert shm.held_bytes() == 0


def test_a_fifo_in_its_place_is_refused_without_blocking():
    ref = kvshm.ShmRef(os.path.join(kvshm.SHM_DIR, "disagg-kv-" + os.urandom(16).hex()), 10)
    os.mkfifo(ref.path, 0o600)
    try:
        with pytest.raises(KVPayloadError, match="not a file"):
            kvshm.open_payload(ref)
    finally:
        os.unlink(ref.path)
