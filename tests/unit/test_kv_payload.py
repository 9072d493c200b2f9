import numpy as np
import pytest

from disagg.engine.config import ModelArgs
from disagg.engine.kv_payload import KVPayload
from disagg.errors import KVPayloadError

pytestmark = pytest.mark.unit

ARGS = ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    hidden_dim=128,
    vocab_size=100,
    fingerprint="f" * 64,
)


def payload(num_tokens: int = 5, args: ModelArgs = ARGS) -> KVPayload:
    rng = np.random.default_rng(0)
    shape = (args.n_layers, args.n_kv_heads, num_tokens, args.head_dim)
    return KVPayload.from_arrays(
        args,
        rng.standard_normal(shape, dtype=np.float32),
        rng.standard_normal(shape, dtype=np.float32),
    )


def test_bytes_round_trip_is_exact():
    p = payload()
    q = KVPayload.from_bytes(p.to_bytes())
    assert q.metadata() == p.metadata()
    np.testing.assert_array_equal(q.k, p.k)
    np.testing.assert_array_equal(q.v, p.v)
    q.check_compatible(ARGS)
    assert p.nbytes == 2 * 2 * 2 * 5 * 16 * 4


def test_corrupted_byte_is_detected():
    data = bytearray(payload().to_bytes())
    data[-7] ^= 0x40
    with pytest.raises(KVPayloadError, match="CRC"):
        KVPayload.from_bytes(bytes(data))


def test_truncated_and_junk_payloads_are_refused():
    data = payload().to_bytes()
    with pytest.raises(KVPayloadError, match="truncated"):
        KVPayload.from_bytes(data[:-4])
    with pytest.raises(KVPayloadError, match="magic"):
        KVPayload.from_bytes(b"hello world")
    with pytest.raises(KVPayloadError, match="header"):
        KVPayload.from_bytes(data[:8] + b"{not json" + data[17:])


def test_payload_for_another_model_is_refused():
    other = ModelArgs(**{**ARGS.to_json(), "fingerprint": "0" * 64})
    with pytest.raises(KVPayloadError, match="is for model"):
        payload().check_compatible(other)


def test_payload_with_another_shape_is_refused():
    more_layers = ModelArgs(**{**ARGS.to_json(), "n_layers": 3})
    with pytest.raises(KVPayloadError, match="expected float32"):
        payload().check_compatible(more_layers)


def test_payload_with_another_layout_version_is_refused():
    p = payload()
    newer = KVPayload(**{**p.__dict__, "layout_version": 99})
    with pytest.raises(KVPayloadError, match="layout version"):
        newer.check_compatible(ARGS)


def test_pack_gathers_strided_views_into_a_reused_buffer():
    p = payload(num_tokens=5)
    big_k = np.zeros((2, 2, 64, 16), np.float32)  # a prefill work buffer, longer than needed
    big_v = np.zeros_like(big_k)
    big_k[:, :, :5], big_v[:, :, :5] = p.k, p.v
    strided = KVPayload.from_arrays(ARGS, big_k[:, :, :5], big_v[:, :, :5])
    buf = np.full(strided.packed_size() + 100, 7, np.uint8)
    packed = strided.pack(buf)
    assert packed.base is buf or np.shares_memory(packed, buf)
    assert packed.tobytes() == p.to_bytes()
    q = KVPayload.from_bytes(packed)
    np.testing.assert_array_equal(q.k, p.k)


# ------------------------------------------------------------------ partial payloads


def _header_with(data: bytes, **changes) -> bytes:
    """`data` with header fields changed (CRC left as it was: it covers K and V only)."""
    import json
    import struct

    (hlen,) = struct.unpack("<I", data[4:8])
    header = json.loads(data[8 : 8 + hlen]) | changes
    return data[:8] + json.dumps(header).encode().ljust(hlen) + data[8 + hlen :]


def test_a_partial_payload_round_trips_its_start_and_a_prefix_makes_it_whole():
    whole = payload(num_tokens=48)
    k, v = whole.k[:, :, 32:], whole.v[:, :, 32:]
    part = KVPayload.from_arrays(ARGS, k, v, start=32)
    assert (part.num_tokens, part.num_prompt_tokens, part.layout_version) == (16, 48, 2)
    assert part.nbytes == whole.nbytes // 3  # only what decode lacks travels
    q = KVPayload.from_bytes(part.to_bytes())
    assert (q.start, q.num_tokens, q.layout_version) == (32, 16, 2)
    q.check_compatible(ARGS)
    np.testing.assert_array_equal(q.k, k)
    made = q.with_prefix(whole.k[:, :, :32], whole.v[:, :, :32])
    assert (made.start, made.num_tokens, made.layout_version) == (0, 48, 1)
    np.testing.assert_array_equal(made.k, whole.k)
    np.testing.assert_array_equal(made.v, whole.v)
    with pytest.raises(KVPayloadError, match="a prefix of 16 positions"):
        q.with_prefix(whole.k[:, :, :16], whole.v[:, :, :16])


@pytest.mark.parametrize("start", [-16, 1.5, "32", True, None])
def test_a_payload_with_a_bad_start_is_refused_on_import(start):
    part = KVPayload.from_arrays(ARGS, *(payload(16).k, payload(16).v), start=32)
    with pytest.raises(KVPayloadError, match="start must be an integer"):
        KVPayload.from_bytes(_header_with(part.to_bytes(), start=start))


def test_a_start_that_does_not_fit_its_layout_version_is_refused():
    part = KVPayload.from_arrays(ARGS, payload(16).k, payload(16).v, start=32)
    # a version 1 reader would take this for a whole prompt: so it is never version 1
    forged = KVPayload.from_bytes(_header_with(part.to_bytes(), layout_version=1))
    with pytest.raises(KVPayloadError, match="does not fit its start"):
        forged.check_compatible(ARGS)
    with pytest.raises(KVPayloadError, match="start must be an integer"):
        KVPayload(**{**part.__dict__, "start": -1}).check_compatible(ARGS)


def test_a_skip_must_be_whole_blocks_and_leave_the_last_token():
    from disagg.engine.kv_payload import check_start

    check_start(32, num_prompt_tokens=33, block_size=16)
    with pytest.raises(KVPayloadError, match="not a multiple of the block size 16"):
        check_start(20, num_prompt_tokens=40, block_size=16)
    with pytest.raises(KVPayloadError, match="leaves none of the prompt's 32 tokens"):
        check_start(32, num_prompt_tokens=32, block_size=16)
