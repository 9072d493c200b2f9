"""The Triton adapter modules (pb, the pools' callers and the pool models' sides, runner)
against the stand-in for triton_python_backend_utils (tests/fakes): reading request tensors,
responses and errors, both sides of each pool's contract, and how entry models answer their
callers."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from disagg import contracts as C
from disagg.codec.generate import ENSEMBLE_OUTPUTS
from disagg.engine.sequence import SamplingParams
from disagg.errors import ConfigError, KVPayloadError, KVPrefixMissError, PoolError, RequestError

pytestmark = pytest.mark.unit
FAKES = Path(__file__).resolve().parents[1] / "fakes"
ADAPTER = (
    "disagg.triton.bls",
    "disagg.triton.decode_side",
    "disagg.triton.local_pipeline",
    "disagg.triton.pb",
    "disagg.triton.pb_metrics",
    "disagg.triton.pools",
    "disagg.triton.prefill_side",
    "disagg.triton.runner",
)


@pytest.fixture
def t(monkeypatch):
    """The adapter modules, imported against the stand-in."""
    monkeypatch.syspath_prepend(str(FAKES))
    for name in [m for m in sys.modules if m.startswith(ADAPTER)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "triton_python_backend_utils", raising=False)
    monkeypatch.setenv(C.TOKEN_ENV, "t0ken")
    import triton_python_backend_utils as u

    # import_module, not `from disagg.triton import ...`: the package keeps the modules an
    # earlier test imported against another copy of the stand-in
    mods = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in ADAPTER}
    u.InferenceRequest.script = []
    return type("Adapter", (), {"u": u, **mods})


def _request(t, inputs: dict, **kw):
    return t.u.InferenceRequest(
        "model", inputs=[t.u.Tensor(k, np.asarray(v)) for k, v in inputs.items()], **kw
    )


def _outputs(response) -> dict:
    return {x.name(): x.as_numpy() for x in response.output_tensors()}


# ------------------------------------------------------------------ pb: reading and answering


def test_fields_are_read_by_kind_and_a_batch_of_two_is_refused(t):
    kinds = {"a": "str", "b": "int", "c": "float", "d": "bool", "e": "strs", "f": "ints"}
    req = _request(
        t,
        {
            "a": [["héllo".encode()]],
            "b": [[7]],
            "c": [[0.5]],
            "d": [[True]],
            "e": [[b"x", b"y"]],
            "f": [[1, 2, 3]],
        },
    )
    fields = t.pb.read_fields(req, kinds, batched=True)
    assert fields == {"a": "héllo", "b": 7, "c": 0.5, "d": True, "e": ["x", "y"], "f": [1, 2, 3]}
    assert t.pb.read_fields(req, {"absent": "int"}, batched=True) == {}
    with pytest.raises(RequestError, match="batch size must be 1"):
        t.pb.read_fields(_request(t, {"b": [[1], [2]]}), {"b": "int"}, batched=True)
    with pytest.raises(RequestError, match="exactly one value"):
        t.pb.read_fields(_request(t, {"b": [[1, 2]]}), {"b": "int"}, batched=True)
    with pytest.raises(RequestError, match="not valid UTF-8"):
        t.pb.read_fields(_request(t, {"a": [[b"\xff"]]}), {"a": "str"}, batched=True)


@pytest.mark.parametrize(
    "exc, code, kind",
    [
        (RequestError("prompt is empty"), "INVALID_ARG", C.INVALID_REQUEST),
        (PoolError("decode is down"), "UNAVAILABLE", C.UNAVAILABLE),
        (RuntimeError("a bug"), "INTERNAL", C.INTERNAL),
        (KVPrefixMissError("holds 0 of the 32"), "UNAVAILABLE", C.PREFIX_MISS),
    ],
)
def test_an_error_response_carries_its_kind_in_the_code_and_the_message(t, exc, code, kind):
    err = t.pb.error_response(exc).error()
    assert err.code() == getattr(t.u.TritonError, code)
    assert C.split_error(err.message()) == (kind, str(exc))
    # a model behind us tagged it already: the caller passes it on unchanged
    again = t.pb.error_response(RequestError(err.message())).error().message()
    assert again == err.message()


def test_a_failed_sub_request_keeps_a_client_error_a_client_error(t):
    bad = t.pb.error_response(RequestError("max_tokens too big"))
    with pytest.raises(RequestError, match="^max_tokens too big$"):
        t.pb.raise_for_error(bad, "prefill")
    with pytest.raises(PoolError, match="prefill: .*engine broke"):
        t.pb.raise_for_error(t.pb.error_response(RuntimeError("engine broke")), "prefill")
    t.pb.raise_for_error(t.u.InferenceResponse([]), "prefill")  # no error: nothing raised
    miss = t.pb.error_response(KVPrefixMissError("holds 0 of the 32"))
    with pytest.raises(KVPrefixMissError, match="^decode: holds 0 of the 32$"):
        t.pb.raise_for_error(miss, "decode")  # the orchestrator resends the whole prompt


def test_the_routers_final_response_says_where_it_was_routed(t):
    reply = C.RoutedReply("hi", 3, 1, "stop", target="lpu", reason="interactive", served_by="groq")
    out = _outputs(t.pb.routed_response(reply, batched=True))
    assert out[C.TEXT_OUTPUT].shape == (1, 1) and out[C.TEXT_OUTPUT][0, 0] == b"hi"
    assert (out[C.ROUTE_TARGET][0, 0], out[C.SERVED_BY][0, 0]) == (b"lpu", b"groq")
    delta = _outputs(t.pb.routed_response(C.RoutedReply("h", 3, 1), batched=True))
    assert set(delta) == set(ENSEMBLE_OUTPUTS.names)  # routing outputs on the final one only


def test_model_parameters_arrive_typed(t):
    config = {
        "parameters": {
            "decode_max_num_seqs": {"string_value": "4"},
            "prefill_timeout_s": {"string_value": "2.5"},
            "gateway_auth": {"string_value": "False"},
            "run_dir": {"string_value": "/run"},
        }
    }
    p = t.pb.model_parameters({"model_config": json.dumps(config), "model_name": "decode"})
    assert (p.decode_max_num_seqs, p.prefill_timeout_s, p.gateway_auth, p.run_dir) == (
        4,
        2.5,
        False,
        "/run",
    )
    bad = {"parameters": {"decode_max_num_seqs": {"string_value": "four"}}}
    with pytest.raises(ConfigError, match="expected int"):
        t.pb.model_parameters({"model_config": json.dumps(bad)})


# ------------------------------------------------------------------ pools: both sides


class _Result:
    first_token, seed = 42, 9


def test_prefill_pool_reads_what_the_prefill_model_sends(t):
    payload = np.arange(32, dtype=np.uint8)
    t.u.InferenceRequest.script = [
        t.prefill_side.prefill_response(
            _Result, payload, pid=77, compute_us=1500, start_ns=2_000_000_000
        )
    ]
    pool = t.pools.BlsPrefillPool("prefill", timeout_s=3.0)
    handoff = pool.prefill("r1", [1, 2, 3], SamplingParams(max_tokens=4))
    assert (handoff.first_token, handoff.seed, handoff.worker_pid) == (42, 9, 77)
    assert C.SKIP_TOKENS not in {i.name() for i in t.u.InferenceRequest.last.inputs}
    pool.prefill("r1", list(range(40)), SamplingParams(max_tokens=4), skip_tokens=32)
    skip = t.u.get_input_tensor_by_name(t.u.InferenceRequest.last, C.SKIP_TOKENS)
    assert skip.as_numpy().tolist() == [32]  # what decode holds stays out of the payload
    assert np.array_equal(handoff.kv_payload, payload)
    assert (handoff.prefill_time_s, handoff.start_wall_s) == (0.0015, 2.0)
    sent = t.u.InferenceRequest.last
    assert sent.timeout == 3_000_000 and json.loads(sent.parameters())[C.TOKEN_PARAM] == "t0ken"
    t.u.InferenceRequest.script = t.u.TritonModelException("model 'prefill' is not ready")
    with pytest.raises(PoolError, match="not ready"):
        pool.prefill("r2", [1], SamplingParams())


def test_decode_pool_reads_what_the_decode_models_sink_sends(t, tmp_path):
    """SenderSink's responses, fed to BlsDecodePool: the acknowledgement, tokens, the end."""
    from disagg.cancel import CancelRegistry

    caller = t.u.InferenceRequest("decode")
    sink = t.decode_side.SenderSink(caller.sender, pid=55, to_bls=True)
    sink.send([], None)
    sink.send([5, 6], None)
    sink.send([7], "length")
    t.u.InferenceRequest.script = [response for response, _ in caller.sender.sent]
    pool = t.pools.BlsDecodePool("decode", CancelRegistry(tmp_path), liveness_check_s=0.05)
    stream = pool.generate("r1", SamplingParams(), prompt_ids=[1, 2])
    steps = [next(stream)]
    pool.cancel("r1")  # while it streams (a stop string, the client gone)
    assert CancelRegistry(tmp_path).is_marked("r1.abc")  # the orchestrator's ids extend it
    steps += list(stream)
    assert [s.token_ids for s in steps] == [[], [5, 6], [7]]
    assert steps[-1].finish_reason == "length" and {s.worker_pid for s in steps} == {55}
    assert caller.sender.sent[-1][1] == t.u.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    CancelRegistry(tmp_path).clear("r1")
    pool.cancel("r1")  # the stream has ended (or decode failed it): nothing to stop
    assert not CancelRegistry(tmp_path).is_marked("r1")


def test_a_sink_reports_decode_load_only_to_callers_that_ask(t):
    caller = t.u.InferenceRequest("decode")
    t.decode_side.SenderSink(caller.sender, 55, load=lambda: (3, 1, 5, 800)).send([9], None)
    t.decode_side.SenderSink(caller.sender, 55).send([9], None)
    (with_load, _), (without, _) = caller.sender.sent
    assert _outputs(with_load)[C.DECODE_LOAD].tolist() == [3, 1, 5, 800]
    assert C.DECODE_LOAD not in _outputs(without)  # unrequested outputs are never sent


def test_a_decode_failure_after_the_first_response_travels_as_outputs(t):
    """Triton 2.51 drops a BLS stream's error response after the first one (contracts.py)."""
    request = t.u.InferenceRequest("decode")
    sink = t.decode_side.SenderSink(request.sender, pid=55, to_bls=True)
    sink.send([], None)
    sink.fail(PoolError("decode engine died"))
    last, flags = request.sender.sent[-1]
    assert not last.has_error() and flags == t.u.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert _outputs(last)[C.ERROR_KIND][0] == C.UNAVAILABLE.encode()
    first_only = t.u.InferenceRequest("decode")
    t.decode_side.SenderSink(first_only.sender, 55, to_bls=True).fail(RequestError("bad"))
    assert first_only.sender.sent[0][0].has_error()  # a first response arrives as an error


def test_a_sink_refuses_to_send_to_a_caller_that_died(t):
    from disagg.triton.bls import CallerWatch

    dead = CallerWatch(pid=2**22 + 12345)  # above any pid this machine hands out
    request = t.u.InferenceRequest("decode")
    sink = t.decode_side.SenderSink(request.sender, 55, to_bls=True, caller=dead)
    with pytest.raises(PoolError, match="died"):
        sink.send([1], None)
    assert request.sender.sent == [] and sink.is_cancelled()


def test_decode_reads_a_kv_handoff_or_prompt_ids(t):
    from disagg.engine.kv_payload import KVPayload

    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 1, 3, 4)).astype(np.float32)
    kv = KVPayload("f", num_layers=2, num_kv_heads=1, head_dim=4, num_tokens=3, k=k, v=-k)
    req = _request(
        t,
        {C.KV_PAYLOAD: kv.pack(), C.FIRST_TOKEN: [11], C.RESOLVED_SEED: np.array([5], np.uint64)},
    )
    _, result, prompt = t.decode_side.read_decode_call(req, "r1")
    assert prompt is None and (result.first_token, result.seed) == (11, 5)
    assert np.array_equal(result.kv.k, k) and np.array_equal(result.kv.v, -k)
    call = t.decode_side.read_decode_call(_request(t, {C.PROMPT_IDS: [3, 4]}), "r2")
    assert call[1:] == (None, [3, 4])
    with pytest.raises(RequestError, match="give kv_payload"):
        t.decode_side.read_decode_call(_request(t, {}), "r3")
    with pytest.raises(KVPayloadError, match="needs first_token"):
        t.decode_side.read_decode_call(_request(t, {C.KV_PAYLOAD: kv.pack()}), "r4")


def test_the_routers_local_pipeline_skips_acknowledgements(t, tmp_path):
    from disagg.cancel import CancelRegistry

    reply = C.Reply("Paris", 5, 1, finish_reason="stop", served_by=C.DISAGGREGATED)
    t.u.InferenceRequest.script = [
        t.u.InferenceResponse([t.pb.tensor(C.WORKER_PID, [9], np.int32)]),  # acknowledgement
        t.pb.reply_response(reply, batched=True),
        t.u.InferenceResponse([]),  # the empty response that carries FINAL
    ]
    local = t.local_pipeline.BlsLocalPipeline(CancelRegistry(tmp_path))
    fields = {C.INPUT_IDS: [1, 2], C.MAX_TOKENS: 4, C.TEXT_INPUT: "hi", C.SEED: 3}
    (only,) = list(local.generate("orchestrator", "r1", fields))
    assert (only.text, only.finish_reason, only.served_by) == ("Paris", "stop", C.DISAGGREGATED)
    sent = {x.name(): x.as_numpy() for x in t.u.InferenceRequest.last.inputs}
    assert sent[C.SEED].dtype == np.uint64 and sent[C.INPUT_IDS].shape == (1, 2)


# ------------------------------------------------------------------ runner


def _runner(t, run, decoupled=True, errors=None):
    def parse(request):
        if t.pb.input_array(request, "bad") is not None:
            raise RequestError("no good")
        return type("Req", (), {"request_id": request.request_id()})

    return t.runner.RequestRunner(
        decoupled,
        2,
        parse=parse,
        run=run,
        respond=lambda reply, requested=frozenset(): t.pb.reply_response(reply, True, requested),
        on_error=(errors.append if errors is not None else None),
    )


def _wait_final(request, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if request.sender.sent and request.sender.sent[-1][1]:
            return request.sender.sent
        time.sleep(0.01)
    raise AssertionError("no final response")


def test_a_bls_caller_is_acknowledged_first_and_gets_failures_as_outputs(t):
    from disagg.triton.bls import BLS_PARAMETERS

    def run(req, emit, is_cancelled):
        emit(C.Reply("a", 1, 1))
        raise PoolError("decode died")

    errors: list[str] = []
    runner = _runner(t, run, errors=errors)
    request = t.u.InferenceRequest("orchestrator", parameters=BLS_PARAMETERS, request_id="x")
    runner.execute([request])
    sent = _wait_final(request)
    assert C.WORKER_PID in _outputs(sent[0][0])  # the acknowledgement
    assert _outputs(sent[1][0])[C.TEXT_OUTPUT].reshape(-1)[0] == b"a"
    final, flags = sent[-1]
    assert flags and not final.has_error()
    assert _outputs(final)[C.ERROR_KIND].reshape(-1)[0] == C.UNAVAILABLE.encode()
    assert errors == [C.UNAVAILABLE]
    runner.shutdown()


def test_a_client_gets_a_bad_request_at_once_and_only_what_it_asked_for(t):
    def run(req, emit, is_cancelled):
        return C.Reply("done", 1, 1, finish_reason="stop", served_by="colocated")

    runner = _runner(t, run)
    bad = _request(t, {"bad": [1]})
    runner.execute([bad])
    ((response, flags),) = bad.sender.sent
    assert response.has_error() and flags
    assert C.split_error(response.error().message()) == (C.INVALID_REQUEST, "no good")
    good = t.u.InferenceRequest("orchestrator", requested_output_names=[C.TEXT_OUTPUT])
    runner.execute([good])
    ((final, flags),) = _wait_final(good)
    assert set(_outputs(final)) == {C.TEXT_OUTPUT}  # Triton would prune the rest without the GIL
    runner.shutdown()


def test_a_non_decoupled_batch_gets_one_response_per_request(t):
    def run(req, emit, is_cancelled):
        return C.Reply(req.request_id, 1, 1, finish_reason="stop")

    runner = _runner(t, run, decoupled=False)
    reqs = [t.u.InferenceRequest("o", request_id=f"r{i}") for i in range(3)]
    responses = runner.execute([*reqs, _request(t, {"bad": [1]})])
    texts = [_outputs(r)[C.TEXT_OUTPUT].reshape(-1)[0] for r in responses[:3]]
    assert texts == [b"r0", b"r1", b"r2"] and responses[3].has_error()
    runner.shutdown()


# ------------------------------------------------------------------ pb_metrics


def test_a_restarted_decode_does_not_report_the_dead_ones_sequences(t):
    """Triton keeps a killed stub's series; the next process's gauges start from zero."""
    from disagg.contracts import DecodeStats

    t.u.MetricFamily.registry.clear()
    series = ("disagg_decode_active_sequences", (("instance", "decode_0"), ("model", "decode")))
    dead = t.pb_metrics.DecodeMetrics("decode", "decode_0")
    dead.on_step(DecodeStats(num_running=4, num_waiting=2))
    t.pb_metrics.close_metrics()  # applies what is queued
    assert t.u.MetricFamily.registry[series].value == 6
    t.pb_metrics.DecodeMetrics("decode", "decode_0")  # the restarted process, no step yet
    t.pb_metrics.close_metrics()
    assert t.u.MetricFamily.registry[series].value == 0


def test_a_replica_that_left_the_list_reads_down_with_nothing_on_it(t, tmp_path):
    """Scaled down (its address gone from the pool's file): its series must not keep the last
    outstanding count and up=1, which the live planner would read as load on a replica."""
    from disagg.remote.replicas import ReplicaSet

    t.u.MetricFamily.registry.clear()
    listed = tmp_path / "decode.txt"
    listed.write_text("127.0.0.1:1\n127.0.0.1:2\n")
    rs = ReplicaSet(f"file:{listed}", probe=lambda a: True, resolve_s=0.0)
    rs.choose()  # reads the file
    gone = next(r for r in rs.replicas if r.address == "127.0.0.1:2")
    gone.outstanding = 3
    metrics = t.pb_metrics.ReplicaMetrics({"decode": rs}, interval_s=3600)
    metrics.refresh()  # exports 3 on it
    listed.write_text("127.0.0.1:1\n")
    rs.choose()
    metrics.refresh()
    t.pb_metrics.close_metrics()  # applies what is queued, in order
    key = (("pool", "decode"), ("replica", "127.0.0.1:2"))
    registry = t.u.MetricFamily.registry
    assert registry[("disagg_replica_outstanding_requests", key)].value == 0
    assert registry[("disagg_replica_up", key)].value == 0
    up = (("pool", "decode"), ("replica", "127.0.0.1:1"))
    assert registry[("disagg_replica_up", up)].value == 1
    metrics.stop()


def test_set_nice_lowers_every_thread_and_the_threads_made_after(tmp_path):
    """Niceness is per thread on Linux: a thread started before the call is set too, and
    one started after inherits it (torch's pool is made after). In a child process, so this
    test's own priority is untouched."""
    script = f"""
import os, sys, threading
sys.path.insert(0, {str(FAKES)!r})
from disagg.triton import pb
ready, stop = threading.Event(), threading.Event()
before = threading.Thread(target=lambda: (ready.set(), stop.wait()))
before.start(); ready.wait()
pb.set_nice(7)
seen = {{}}
after = threading.Thread(target=lambda: seen.update(n=os.getpriority(os.PRIO_PROCESS, 0)))
after.start(); after.join()
print(os.getpriority(os.PRIO_PROCESS, before.native_id), seen["n"])
stop.set()
"""
    import subprocess

    if os.getpriority(os.PRIO_PROCESS, 0) > 7:
        pytest.skip("this test process runs below niceness 7's priority already")
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["7", "7"], out
