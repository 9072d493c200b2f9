"""Cancellation across the hand-off (issue 27, item 3): a client that leaves before its first
token stops the prefill at its next layer, the orchestrator hands nothing to decode and the
KV lease is dropped at once; the watch that marks a Triton-cancelled request while its
thread waits; the same over gRPC and for TensorRT-LLM's context request (its test double).
The real thing on a tritonserver: tests/integration/test_cancel_prefill.py."""

from __future__ import annotations

import importlib
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.scripted import ScriptedDecode, StubTokenizer, model_args

from disagg import contracts as C
from disagg.cancel import CancelRegistry, CancelWatch, Throttled
from disagg.contracts import DISAGGREGATED, Handoff, Reply
from disagg.engine.config import EngineConfig
from disagg.engine.interrupt import until_stopped
from disagg.engine.sequence import SamplingParams
from disagg.errors import PoolError, RequestCancelledError
from disagg.kvnet import KVLeases, KVRef, KVServer
from disagg.pipeline.interfaces import OrchestratorEvents
from disagg.pipeline.orchestrator import Orchestrator
from disagg.pipeline.request import GenerateRequest
from disagg.remote import pools as remote_pools
from disagg.remote.replicas import Replica

pytestmark = pytest.mark.unit
FAKES = Path(__file__).resolve().parents[1] / "fakes"


@pytest.fixture
def t(monkeypatch):
    """The adapter modules used here, imported against the stand-in for
    triton_python_backend_utils (as tests/unit/test_triton_adapter.py does)."""
    monkeypatch.syspath_prepend(str(FAKES))
    adapter = ("disagg.triton.",)
    for name in [m for m in sys.modules if m.startswith(adapter)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "triton_python_backend_utils", raising=False)
    import triton_python_backend_utils as u

    mods = {n: importlib.import_module(f"disagg.triton.{n}") for n in ("runner", "prefill_side")}
    return type("Adapter", (), {"u": u, **mods})


def test_a_prefill_stops_before_the_next_layer_once_asked():
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 3

    done = []
    with pytest.raises(RequestCancelledError, match="client went away"):
        for i, layer in until_stopped(["l0", "l1", "l2", "l3", "l4"], stop):
            done.append((i, layer))
    assert done == [(0, "l0"), (1, "l1"), (2, "l2")]  # the fourth was never started
    assert list(until_stopped(["a", "b"], None)) == [(0, "a"), (1, "b")]


def test_a_throttled_check_asks_at_most_once_an_interval_and_stays_true():
    answers, asked = iter([False, True, False]), []

    def check() -> bool:
        asked.append(1)
        return next(answers)

    t = Throttled(check, interval_s=0.05)
    assert not t() and not t() and len(asked) == 1  # the second within the interval
    time.sleep(0.06)
    assert t() and len(asked) == 2
    time.sleep(0.06)
    assert t() and len(asked) == 2  # cancelled for good: not asked again


def test_a_throttled_check_asked_now_ignores_the_interval():
    answers, asked = iter([False, True]), []

    def check() -> bool:
        asked.append(1)
        return next(answers)

    t = Throttled(check, interval_s=3600)
    assert not t() and not t() and len(asked) == 1
    assert t.now() and len(asked) == 2  # the last look before an answer is a real one
    assert t() and len(asked) == 2


def test_the_watch_marks_a_cancelled_request_and_clears_its_mark_when_it_ends(tmp_path):
    cancels = CancelRegistry(tmp_path)
    watch = CancelWatch(cancels, poll_s=3600)  # polled by hand below
    flags = {"r1": False, "r2": False}
    for rid in flags:
        watch.add(rid, lambda rid=rid: flags[rid])
    assert watch.poll() == [] and not cancels.is_marked("r1.child")
    flags["r1"] = True
    assert watch.poll() == ["r1"]
    assert cancels.is_marked("r1.child") and not cancels.is_marked("r2")  # its children too
    assert watch.poll() == []  # marked once
    watch.remove("r1")
    assert not cancels.is_marked("r1")  # the mark did its work
    watch.remove("r2")
    flags["r2"] = True
    assert watch.poll() == [] and not cancels.is_marked("r2")  # ended: nothing left behind
    watch.stop()


def test_the_runner_marks_a_request_triton_cancelled_while_its_run_waits(t, tmp_path):
    """A streaming request whose client leaves while its run waits (on a prefill: nothing is
    sent) is marked within a poll, so whatever serves it sees it, and so does the run."""
    cancels = CancelRegistry(tmp_path)
    seen = {}

    def run(req, emit, is_cancelled):
        deadline = time.monotonic() + 5  # (what serves it looks for a mark on its child id)
        while not cancels.is_marked(req.request_id + ".prefill") and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["marked"] = cancels.is_marked(req.request_id + ".prefill")
        seen["cancelled"] = is_cancelled()
        return Reply("", 1, 0, finish_reason="abort")

    class Req:
        request_id = "router-1"

    r = t.runner.RequestRunner(
        True, 2, parse=lambda request: Req(), run=run, respond=lambda reply, requested=(): None,
        batched=False, cancels=cancels,
    )  # fmt: skip
    request = t.u.InferenceRequest(request_id="router-1")
    start = time.monotonic()
    r.execute([request])
    time.sleep(0.1)
    request.sender.cancelled = True  # the client's gRPC call was cancelled
    r.workers.shutdown(wait=True)
    assert seen["marked"] and seen["cancelled"]
    assert time.monotonic() - start < 2  # within a poll or so, not the 5 s the run would wait
    assert not cancels.is_marked("router-1")  # cleared when the request ended
    r.shutdown()


def test_a_prefill_request_is_cancelled_by_triton_or_by_its_callers_mark(t, tmp_path):
    cancels = CancelRegistry(tmp_path)
    request = t.u.InferenceRequest(request_id="router-1.abc")
    check = t.prefill_side.cancel_check(request, cancels, interval_s=0.0)
    assert not check()
    request.cancelled = True  # over gRPC: Triton passes the call's cancellation on
    assert check()
    other = t.u.InferenceRequest(request_id="router-2.abc")
    by_mark = t.prefill_side.cancel_check(other, cancels, interval_s=0.0)
    cancels.mark("router-2")  # over BLS: the router marks its own id
    assert by_mark()


# ---------------------------------------------------------------- the orchestrator


class LeasingPrefill:
    """A prefill pool whose payload is leased on a real KVServer (the cross-server path);
    `leave_during` makes the client leave while it runs."""

    def __init__(self, server: KVServer, first_token: int, error: Exception | None = None):
        self.server, self.first_token, self.error = server, first_token, error
        self.left = threading.Event()

    def prefill(self, request_id, prompt_ids, params, skip_tokens=0):
        self.left.set()  # the client goes away while this runs
        if self.error is not None:
            raise self.error
        data = np.arange(4096, dtype=np.uint8)
        ref = KVRef(self.server.address(), self.server.leases.put(data), data.nbytes)
        payload = np.frombuffer(ref.to_bytes(), np.uint8)
        return Handoff(self.first_token, 7, payload, 111, 0.01)


class Events(OrchestratorEvents):
    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []

    def error(self, stage: str, kind: str) -> None:
        self.errors.append((stage, kind))


@pytest.fixture
def kv_server(monkeypatch):
    monkeypatch.setenv(C.TOKEN_ENV, "internal-token")
    srv = KVServer(KVLeases(capacity_bytes=1 << 20, ttl_s=300), "internal-token").start()
    yield srv
    srv.close()


TOK = StubTokenizer()
FIRST, *REST = TOK.encode(" one two three")  # the reply's token ids


def serve(prefill, decode, cancelled):
    tok = TOK
    events = Events()
    o = Orchestrator(
        tok, model_args(), EngineConfig(), prefill, decode, DISAGGREGATED, events=events
    )
    req = GenerateRequest("rid", tok.encode("Hi there"), "Hi there", SamplingParams(max_tokens=8))
    return o.run(req, lambda r: None, cancelled), events


def test_a_client_gone_during_prefill_gets_no_decode_and_its_lease_is_dropped_at_once(kv_server):
    prefill, decode = LeasingPrefill(kv_server, FIRST), ScriptedDecode(REST)
    final, events = serve(prefill, decode, prefill.left.is_set)
    assert final.finish_reason == "abort" and decode.calls == []
    assert kv_server.leases.held_bytes == 0 and len(kv_server.leases) == 0  # not after the TTL
    assert kv_server.leases.expired == 0 and events.errors == []


def test_a_prefill_stopped_for_its_client_is_no_pool_failure_and_has_no_fallback(kv_server):
    prefill = LeasingPrefill(kv_server, FIRST, error=RequestCancelledError("prefill cancelled"))
    decode = ScriptedDecode(REST)
    final, events = serve(prefill, decode, prefill.left.is_set)
    assert final.finish_reason == "abort" and decode.calls == []  # decode prefilled nothing
    assert events.errors == []
    # the same failure without a cancel: decode's own prefill, as before
    prefill = LeasingPrefill(kv_server, FIRST, error=PoolError("prefill died"))
    final, events = serve(prefill, decode, lambda: False)
    assert final.finish_reason == "length" and decode.calls[-1][0] is None
    assert events.errors == [("prefill", "pool")]


def test_a_request_still_wanted_keeps_its_lease_for_decode(kv_server):
    prefill, decode = LeasingPrefill(kv_server, FIRST), ScriptedDecode(REST)
    final, _ = serve(prefill, decode, lambda: False)
    assert final.finish_reason == "length" and len(kv_server.leases) == 1  # decode pulls it


# ---------------------------------------------------------------- across servers (gRPC)


def test_a_remote_prefill_call_is_cancelled_in_grpc_when_its_request_is_marked(tmp_path):
    class Call:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    class Client:  # a prefill that would take a minute
        def async_infer(self, model, inputs, callback, **kwargs):
            self.request_id, self.call = kwargs["request_id"], Call()
            return self.call

    cancels = CancelRegistry(tmp_path)
    pool = remote_pools.GrpcPrefillPool("a:1", cancels=cancels, cancel_poll_s=0.01)
    client = Client()
    pool.clients.get = lambda address: client
    threading.Timer(0.1, cancels.mark, ["router-1"]).start()
    start = time.monotonic()
    with pytest.raises(RequestCancelledError, match="cancelled: the client went away"):
        pool._call(Replica("a:1"), "router-1.abc", [1, 2, 3], SamplingParams(max_tokens=2), 0)
    assert client.call.cancelled and time.monotonic() - start < 1.0
    assert client.request_id == "router-1.abc"  # the id the prefill server checks


# ---------------------------------------------------------------- TensorRT-LLM


@pytest.fixture
def trt(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES))
    for name in [m for m in sys.modules if m.startswith("tensorrt_llm")]:
        monkeypatch.delitem(sys.modules, name)
    import tensorrt_llm

    tensorrt_llm.LLM.contexts.clear()
    monkeypatch.setattr(tensorrt_llm.LLM, "context_s", 1.0)  # a long context request
    return tensorrt_llm


def test_a_tensorrt_llm_context_request_is_aborted_when_its_client_leaves(trt):
    from disagg.trtllm.engines import TrtllmPrefillEngine
    from disagg.trtllm.sampling import TrtllmApi

    llm = trt.LLM("ckpt")
    engine = TrtllmPrefillEngine(llm, TrtllmApi.load(), max_prompt_tokens=64)
    leave_at = time.monotonic() + 0.1
    start = time.monotonic()
    with pytest.raises(RequestCancelledError, match="aborted"):
        engine.prefill(
            "r1", [1, 2, 3], SamplingParams(max_tokens=4), lambda: time.monotonic() > leave_at
        )
    assert time.monotonic() - start < 0.5  # not the whole second the context takes
    assert llm.held_contexts() == 0  # aborted while it ran: no KV held for a generation half
    result, _ = engine.prefill("r2", [1, 2, 3], SamplingParams(max_tokens=4), lambda: False)
    assert result.first_token == 6 and llm.held_contexts() == 1  # one still wanted is kept


def test_leases_report_the_bytes_they_hold_after_every_change():
    seen: list[int] = []
    leases = KVLeases(capacity_bytes=1 << 20, ttl_s=30, on_change=seen.append)
    a = leases.put(np.zeros(100, np.uint8))
    leases.put(np.zeros(50, np.uint8))
    assert leases.drop(a) and not leases.drop(a)  # a second drop changes nothing
    leases.expire(now=time.monotonic() + 60)
    assert seen == [100, 150, 50, 0]  # what disagg_kv_leased_bytes shows
