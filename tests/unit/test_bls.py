"""The BLS contract (disagg/triton/bls.py) against a stand-in for triton_python_backend_utils
(tests/fakes): failures sent as outputs or as Triton errors are raised with their kind, the
callee's death is noticed, internal models refuse outsiders, and finished streams are held
before Python lets go of them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from disagg import contracts as C
from disagg.errors import PoolError, RequestError

pytestmark = pytest.mark.unit
FAKES = Path(__file__).resolve().parents[1] / "fakes"


@pytest.fixture
def bls(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES))
    for name in [m for m in sys.modules if m.startswith(("disagg.triton.bls", "disagg.triton.pb"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "triton_python_backend_utils", raising=False)
    monkeypatch.setenv(C.TOKEN_ENV, "t0ken")
    from disagg.triton import bls

    return bls


def _response(pb_utils, **outputs):
    return pb_utils.InferenceResponse([pb_utils.Tensor(k, np.array(v)) for k, v in outputs.items()])


def _stream(bls, responses, liveness_check_s=0.05):
    pb_utils = bls.pb_utils
    pb_utils.InferenceRequest.script = responses
    return bls.bls_stream(pb_utils.InferenceRequest("decode"), "decode", liveness_check_s)


def test_a_failure_sent_as_outputs_after_the_acknowledgement_is_raised_with_its_kind(bls):
    u = bls.pb_utils
    ack = _response(u, **{C.WORKER_PID: [1]})
    failed = bls.failure_response(RuntimeError("engine broke"), as_outputs=True)
    with pytest.raises(PoolError, match="decode: engine broke"):
        list(_stream(bls, [ack, failed]))
    bad = bls.failure_response(RequestError("max_tokens too big"), as_outputs=True)
    with pytest.raises(RequestError, match="max_tokens too big"):
        list(_stream(bls, [ack, bad]))


def test_a_triton_error_is_raised_and_an_unreachable_model_is_a_pool_error(bls):
    u = bls.pb_utils
    with pytest.raises(RequestError, match="bad"):
        list(
            _stream(
                bls, [u.InferenceResponse(error=u.TritonError("bad", u.TritonError.INVALID_ARG))]
            )
        )
    with pytest.raises(PoolError, match="not ready"):
        list(_stream(bls, u.TritonModelException("not ready")))


def test_the_death_of_the_acknowledged_process_ends_the_stream(bls):
    child = subprocess.Popen(["sleep", "30"])
    ack = _response(bls.pb_utils, **{C.WORKER_PID: [child.pid]})

    def never_ending():
        yield ack
        time.sleep(3600)  # a dead stub's stream: Triton 2.51 never ends it

    stream = _stream(bls, never_ending())
    assert next(stream) is ack
    child.kill()
    child.wait()
    start = time.monotonic()
    with pytest.raises(PoolError, match=f"decode worker {child.pid} died"):
        next(stream)
    assert time.monotonic() - start < 2


def test_internal_models_take_only_their_own_servers_calls(bls):
    u = bls.pb_utils
    ours = u.InferenceRequest("prefill", parameters=bls.BLS_PARAMETERS)
    bls.check_internal(ours, "prefill")
    assert bls.is_bls_caller(ours)
    for params in (
        {},
        {C.CALLER_PARAM: C.BLS_CALLER},
        {C.CALLER_PARAM: C.BLS_CALLER, C.TOKEN_PARAM: "x"},
    ):
        with pytest.raises(RequestError, match="'prefill' is internal"):
            bls.check_internal(u.InferenceRequest("prefill", parameters=params), "prefill")


def test_a_caller_watch_sees_its_caller_die(bls):
    child = subprocess.Popen(["sleep", "30"])
    u = bls.pb_utils
    req = u.InferenceRequest(
        "decode", parameters={C.CALLER_PARAM: C.BLS_CALLER, C.CALLER_PID_PARAM: child.pid}
    )
    watch = bls.CallerWatch.of(req)
    assert not watch.gone()
    child.kill()
    child.wait()
    assert watch.gone()
    assert not bls.CallerWatch.of(u.InferenceRequest("decode")).gone()  # not a BLS call


def test_finished_streams_are_held_for_a_while_then_released(bls):
    yard = bls.Graveyard(keep_s=10)
    yard.keep("a", now=0.0)
    yard.keep("b", now=5.0)
    assert len(yard) == 2
    yard.keep("c", now=10.5)  # "a" is older than 10 s now
    assert len(yard) == 2
    yard.keep("d", now=30.0)
    assert len(yard) == 1


def test_responses_hold_only_the_outputs_the_requester_asked_for(bls):
    """Triton 2.51 prunes the others itself without the GIL, which corrupted the stub."""
    from disagg.contracts import Reply
    from disagg.triton import pb

    reply = Reply("hi", 3, 1, finish_reason="length", served_by="disaggregated")
    asked = frozenset({C.TEXT_OUTPUT, C.FINISH_REASON, C.SERVED_BY})
    names = {t.name() for t in pb.reply_response(reply, True, asked).output_tensors()}
    assert names == asked
    everything = {t.name() for t in pb.reply_response(reply, True).output_tensors()}
    assert everything > asked and C.KV_BYTES in everything


def test_a_call_that_never_returns_is_a_pool_error_within_first_s(bls):
    """Triton can hand a BLS call to an instance whose stub died; exec then never returns.
    Bounded by first_s, it is a refusal the orchestrator's recovery retries."""
    u = bls.pb_utils
    u.InferenceRequest.script = lambda: time.sleep(3600)
    start = time.monotonic()
    with pytest.raises(PoolError, match=r"decode: no response in 0.3 s$"):
        next(bls.bls_stream(u.InferenceRequest("decode"), "decode", 0.05, first_s=0.3))
    assert time.monotonic() - start < 2


def test_a_live_callee_silent_past_hang_s_ends_the_stream(bls):
    """Acknowledged by a process that lives (this one) and a first token, then nothing: past
    hang_s a PoolError, so the stream moves to another decode instead of hanging; the wait
    for that first token is bounded by stall_s instead."""
    u = bls.pb_utils
    ack = _response(u, **{C.WORKER_PID: [os.getpid()]})
    token = _response(u, x=[1])

    def then_silent():
        yield ack
        yield token
        time.sleep(3600)

    u.InferenceRequest.script = then_silent
    stream = bls.bls_stream(
        u.InferenceRequest("decode"), "decode", 0.05, first_s=5, stall_s=5, hang_s=0.3
    )
    assert next(stream) is ack and next(stream) is token
    start = time.monotonic()
    with pytest.raises(PoolError, match=r"no response in 0.3 s after 2 response\(s\)"):
        next(stream)
    assert 0.25 < time.monotonic() - start < 2
