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
