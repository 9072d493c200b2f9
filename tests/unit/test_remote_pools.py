"""The pools on other servers (disagg/remote/pools.py) read a failed call by its gRPC status
code, never by words in its message, and send the codec's tensors with their dtypes."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from disagg import contracts as C
from disagg.codec.pools import DecodeCall, PrefillCall, PrefillResponse
from disagg.engine.sequence import SamplingParams
from disagg.errors import KVPrefixMissError, PoolError, RequestError
from disagg.remote import pools
from disagg.remote.replicas import Replica

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "status, unreachable",
    [
        ("StatusCode.UNAVAILABLE", True),
        ("StatusCode.DEADLINE_EXCEEDED", True),
        ("StatusCode.CANCELLED", True),
        ("StatusCode.INVALID_ARGUMENT", False),
        (None, False),  # a model's error inside a stream: no status
    ],
)
def test_a_replica_is_unreachable_by_its_status_code(status, unreachable):
    assert pools._unreachable(InferenceServerException("failed", status=status)) is unreachable


def test_words_in_a_message_do_not_make_a_replica_unreachable():
    e = InferenceServerException("the model said StatusCode.UNAVAILABLE", status=None)
    assert not pools._unreachable(e) and pools.grpc_status(e) is None


def test_a_replicas_error_keeps_its_kind():
    bad = InferenceServerException(C.tag_error(C.INVALID_REQUEST, "prompt is empty"))
    with pytest.raises(RequestError, match="^prompt is empty$"):
        pools._raise_for_error(bad, "prefill at a:1")
    with pytest.raises(PoolError, match="prefill at a:1: broke"):
        pools._raise_for_error(InferenceServerException("broke"), "prefill at a:1")
    miss = InferenceServerException(C.tag_error(C.PREFIX_MISS, "holds 0 of the 32"))
    with pytest.raises(KVPrefixMissError, match="decode at a:1: holds 0 of the 32"):
        pools._raise_for_error(miss, "decode at a:1")  # the frontend resends it whole


def test_a_prefill_call_to_another_server_carries_the_skip():
    class Client:
        def async_infer(self, model, inputs, callback, **kwargs):
            self.sent = {t.name(): t for t in inputs}
            arrays = PrefillResponse.encode(5, 1, np.zeros(4, np.uint8), 9, 1, 1, 0, kv_start=32)
            callback(type("Result", (), {"as_numpy": staticmethod(arrays.get)})(), None)

    pool, client = pools.GrpcPrefillPool("a:1"), Client()
    pool.clients.get = lambda address: client
    params = SamplingParams(max_tokens=2)
    handoff = pool._call(Replica("a:1"), "r", list(range(40)), params, skip_tokens=32)
    assert client.sent[C.SKIP_TOKENS].datatype() == "INT32" and handoff.kv_start == 32
    pool._call(Replica("a:1"), "r", list(range(40)), params, skip_tokens=0)
    assert C.SKIP_TOKENS not in client.sent  # a server that predates it takes the call


def test_calls_go_with_the_codecs_dtypes():
    params = SamplingParams(max_tokens=2)
    sent = {t.name(): t.datatype() for t in pools.grpc_inputs(PrefillCall.encode([1, 2], params))}
    assert sent == {C.PROMPT_IDS: "INT32", C.SAMPLING: "BYTES"}
    decode = pools.grpc_inputs(DecodeCall.encode(params, prompt_ids=[3]))
    assert {t.name() for t in decode} == {C.SAMPLING, C.PROMPT_IDS}
    assert pools.remote_parameters()[C.TOKEN_PARAM] == C.internal_token()


def test_a_prefix_miss_is_an_answer_whatever_status_carries_it():
    """decode's prefix miss travels with Triton's UNAVAILABLE code: it must never read as an
    unreachable replica (which is ejected), but as a miss (sent again whole, to it)."""
    miss = InferenceServerException(
        C.tag_error(C.PREFIX_MISS, "holds 0 of the 32"), status="StatusCode.UNAVAILABLE"
    )
    assert not pools._unreachable(miss)
    gone = InferenceServerException("connection refused", status="StatusCode.UNAVAILABLE")
    assert pools._unreachable(gone)


def _route(**kw):
    from disagg.remote.cache_route import RouteParams

    return RouteParams(events=False, **kw)  # no event streams to follow here


class _Prefills:
    """A prefill client per address, counting the calls each got."""

    def __init__(self):
        self.calls: list[str] = []

    def get(self, address):
        calls = self.calls

        class Client:
            def async_infer(self, model, inputs, callback, **kwargs):
                calls.append(address)
                arrays = PrefillResponse.encode(5, 1, np.zeros(4, np.uint8), 9, 1, 1, 0)
                callback(type("Result", (), {"as_numpy": staticmethod(arrays.get)})(), None)

        return Client()


def test_a_conversation_is_prefilled_where_its_earlier_turns_were():
    pool, clients = pools.GrpcPrefillPool("a:1,b:1", route=_route()), _Prefills()
    pool.clients.get = clients.get
    for r in pool.replicas.replicas:
        r.probed = True
    params = SamplingParams(max_tokens=2)
    turn = list(range(100, 164))
    for _ in range(4):
        pool.prefill("r", turn, params)
        turn = turn + list(range(7, 47))  # the reply and the next question
    assert len(clients.calls) == 4 and len(set(clients.calls)) == 1
    # another key's prompt is another namespace: nothing of it is held anywhere
    salted = SamplingParams(max_tokens=2, cache_salt="other-key")
    held = [r.cache.held(pools._key(list(range(100, 164)), salted)) for r in pool.replicas.replicas]
    assert all(h.expected == 0 for h in held)
    # with the cache not to be used, the prompt is chosen by load alone
    assert pools._key(turn, SamplingParams(max_tokens=2, use_cache=False)) is None


def test_a_decode_prefix_miss_goes_again_whole_to_the_same_replica_not_ejected():
    from disagg.contracts import DecodeStep

    pool = pools.GrpcDecodePool("a:1,b:1", route=_route())
    for r in pool.replicas.replicas:
        r.probed = True
        r.cache.instances = 1
    prompt, params = list(range(64)) + [5], SamplingParams(max_tokens=4)
    streams = []

    def stream(replica, request_id, inputs):
        streams.append(replica.address)
        if len(streams) == 1:
            raise KVPrefixMissError(f"decode at {replica.address}: holds 0 of the 64")
        yield DecodeStep([1, 2], None, 7)
        yield DecodeStep([3], "length", 7)

    pool._stream = stream
    held = pool.place("r1", prompt, params)
    home = pool._placed["r1"]
    home.cache.record(pools._key(prompt, params))  # the view said it held the prompt
    with pytest.raises(KVPrefixMissError):
        list(pool.generate("r1", params, handoff=None, prompt_ids=prompt))
    assert home.ejected_until == 0.0 and home.ejections == 0  # not ejected
    assert home.cache.held(pools._key(prompt, params)).expected == 0  # the view corrected
    steps = list(pool.generate("r1", params, handoff=None, prompt_ids=prompt))
    assert streams == [home.address, home.address] and held == 0
    assert [s.token_ids for s in steps] == [[1, 2], [3]]
    # after the reply, the replica holds the prompt and all but the last token
    turn2 = pools._key(prompt + [1, 2, 3, 8, 9], params)
    assert home.cache.held(turn2).expected == 64  # (the full blocks of prompt + [1, 2])
    assert pool.place("r2", turn2.token_ids, params) == 64 and pool._placed["r2"] is home
