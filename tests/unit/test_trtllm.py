"""The TensorRT-LLM adapters against a test double of `tensorrt_llm` (tests/fakes: it stands
for the GPU library, which cannot be installed here). What is checked is disagg's side of the
contract: context_only then generation_only with the same parameters, the hand-off bytes, the
token stream DecodeService sees, aborts and capacity."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from disagg.engine.llm_engine import PrefillResult
from disagg.engine.sequence import FinishReason, SamplingParams
from disagg.errors import CapacityError, KVPayloadError, RequestError
from disagg.pipeline.decode_service import DecodeService
from disagg.trtllm import payload
from disagg.trtllm.engines import TrtllmApi, TrtllmDecodeEngine, TrtllmPrefillEngine

pytestmark = pytest.mark.unit
FAKES = Path(__file__).resolve().parents[1] / "fakes"


@pytest.fixture
def trt(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES))
    for name in [m for m in sys.modules if m.startswith("tensorrt_llm")]:
        monkeypatch.delitem(sys.modules, name)
    import tensorrt_llm

    tensorrt_llm.LLM.contexts.clear()
    return tensorrt_llm


def engines(trt, max_num_seqs=4):
    api = TrtllmApi.load()
    prefill_llm, decode_llm = trt.LLM("ckpt"), trt.LLM("ckpt")
    return (
        TrtllmPrefillEngine(prefill_llm, api, max_prompt_tokens=64),
        TrtllmDecodeEngine(decode_llm, api, max_num_seqs),
        prefill_llm,
        decode_llm,
    )


def drain(engine: TrtllmDecodeEngine, rid: str) -> tuple[list[int], FinishReason]:
    tokens = []
    while True:
        for o in engine.step(wait_s=1.0):
            assert o.request_id == rid
            if o.token_id is not None:
                tokens.append(o.token_id)
            if o.finish_reason is not None:
                return tokens, o.finish_reason


def test_the_hand_off_bytes_round_trip_every_field():
    h = payload.TrtllmHandoff(
        [1, 2, 3], 7, payload.params_to_dict(_params(opaque_state=b"\x00\xffz", future=[1, 2]))
    )
    back = payload.from_bytes(payload.to_bytes(h))
    assert back.prompt_ids == [1, 2, 3] and back.seed == 7
    assert back.params["opaque_state"] == b"\x00\xffz" and back.params["future"] == [1, 2]
    with pytest.raises(KVPayloadError, match="not a TensorRT-LLM"):
        payload.from_bytes(b"KVPAYLOAD...")
    with pytest.raises(KVPayloadError, match="damaged"):
        payload.from_bytes(payload.MAGIC + b"{not json")


def _params(**kw):
    class Params:  # a non-dataclass object with extra fields, as a newer library might have
        def __init__(self, **fields):
            self.__dict__.update(fields)

    return Params(request_type="context_only", ctx_request_id=5, **kw)


def test_prefill_is_a_context_only_request_and_decode_a_generation_only_one(trt):
    prefill, decode, prefill_llm, decode_llm = engines(trt)
    params = SamplingParams(max_tokens=6, temperature=0.0, seed=11)
    result, handoff = prefill.prefill("r1", [5, 6, 7], params)
    kind, prompt, sp, dp = prefill_llm.calls[-1]
    assert (kind, dp.request_type, sp.max_tokens, sp.seed) == ("generate", "context_only", 1, 11)
    wire = payload.to_bytes(handoff)  # what the orchestrator forwards, unparsed
    assert len(wire) < 512
    decode.add_request(
        "r1",
        params,
        prefill=PrefillResult("r1", result.first_token, payload.from_bytes(wire), 11, 0),
    )
    tokens, reason = drain(decode, "r1")
    kind, prompt, sp, dp = decode_llm.calls[-1]
    assert (kind, prompt, dp.request_type) == ("generate_async", [5, 6, 7], "generation_only")
    assert dp.ctx_request_id == handoff.params["ctx_request_id"]
    assert dp.opaque_state == handoff.params["opaque_state"]
    # the orchestrator already has token 0 from prefill: decode sends the rest
    colocated = TrtllmDecodeEngine(trt.LLM("ckpt"), TrtllmApi.load(), 4)
    colocated.add_request("c1", params, prompt_ids=[5, 6, 7])
    all_tokens, _ = drain(colocated, "c1")
    assert [result.first_token] + tokens == all_tokens and len(all_tokens) == 6
    assert reason == FinishReason.LENGTH


def test_a_lost_context_fails_the_request_not_the_engine(trt):
    prefill, decode, _, _ = engines(trt)
    params = SamplingParams(max_tokens=4)
    result, handoff = prefill.prefill("r1", [1, 2], params)
    bad = payload.TrtllmHandoff([9, 9], handoff.seed, handoff.params)  # another prompt
    with pytest.raises(RuntimeError, match="KV cache transfer failed"):
        decode.add_request("r1", params, prefill=PrefillResult("r1", 0, bad, 1, 0))
    assert not decode.has_unfinished


def test_capacity_abort_and_bad_input(trt):
    prefill, decode, _, _ = engines(trt, max_num_seqs=1)
    with pytest.raises(RequestError):
        prefill.prefill("r0", [], SamplingParams())
    with pytest.raises(RequestError, match="over 64"):
        prefill.prefill("r0", list(range(65)), SamplingParams())
    decode.add_request("a", SamplingParams(max_tokens=500), prompt_ids=[1])
    with pytest.raises(CapacityError):
        decode.add_request("b", SamplingParams(max_tokens=5), prompt_ids=[1])
    decode.finish_request("a")
    tokens, reason = drain(decode, "a")
    assert reason == FinishReason.ABORT and len(tokens) < 500
    assert not decode.has_unfinished


class Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.done = threading.Event()

    def send(self, token_ids, finish_reason, num_cached_tokens=0):
        self.tokens += token_ids
        if finish_reason is not None:
            self.finish = finish_reason
            self.done.set()

    def fail(self, error):
        self.finish = f"failed: {error}"
        self.done.set()

    def is_cancelled(self):
        return False


def test_decode_service_drives_the_tensorrt_llm_engine_unchanged(trt):
    prefill, decode, _, _ = engines(trt)
    service = DecodeService(decode).start()
    try:
        sinks = {}
        for i, prompt in enumerate(([1, 2, 3], [4, 5], [6])):
            params = SamplingParams(max_tokens=5 + i)
            result, handoff = prefill.prefill(f"r{i}", prompt, params)
            sinks[i] = (Sink(), result.first_token)
            service.submit(
                f"r{i}",
                params,
                sinks[i][0],
                prefill=PrefillResult(f"r{i}", result.first_token, handoff, handoff.seed, 0),
            )
        for i, (sink, _) in sinks.items():
            assert sink.done.wait(5)
            assert sink.finish == "length" and len(sink.tokens) == 5 + i - 1
    finally:
        service.stop()


def test_greedy_is_top_k_1_and_sampling_keeps_its_parameters(trt):
    """TensorRT-LLM 1.0 decides greedy from top_k/top_p only: temperature=0 would sample."""
    from disagg.trtllm.engines import trt_sampling

    api = TrtllmApi.load()
    greedy = trt_sampling(api, SamplingParams(temperature=0.0, top_p=0.9), seed=1)
    assert greedy.top_k == 1 and greedy.temperature is None and greedy._greedy_decoding
    sampled = trt_sampling(api, SamplingParams(temperature=0.7, top_p=0.9, top_k=40), seed=1)
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.7, 0.9, 40)
    assert not sampled._greedy_decoding


def test_bad_words_go_down_as_single_tokens_or_are_refused(trt):
    from disagg.trtllm.engines import trt_sampling

    api = TrtllmApi.load()
    sp = trt_sampling(api, SamplingParams(bad_words_ids=((5,), (9,))), seed=1)
    assert sp.bad_token_ids == [5, 9]
    with pytest.raises(RequestError, match="longer than one token"):
        trt_sampling(api, SamplingParams(bad_words_ids=((5, 6),)), seed=1)
    prefill, _, _, _ = engines(trt)
    with pytest.raises(RequestError):  # the request's error, a 400: never silently dropped
        prefill.prefill("r", [1, 2], SamplingParams(bad_words_ids=((5, 6),)))


def test_prefill_draws_no_progress_bar(trt):
    prefill, _, prefill_llm, _ = engines(trt)
    prefill.prefill("r1", [1, 2, 3], SamplingParams(max_tokens=3))
    assert prefill_llm.last_use_tqdm is False


def test_a_timed_out_request_ends_as_aborted(trt):
    class TimedOut:
        def __iter__(self):
            yield trt.RequestOutput([trt.CompletionOutput([4], None)])
            yield trt.RequestOutput([trt.CompletionOutput([4, 5], "timeout")])

        def abort(self):
            pass

    _, decode, _, decode_llm = engines(trt)
    decode_llm.generate_async = lambda *a, **k: TimedOut()
    decode.add_request("t", SamplingParams(max_tokens=9), prompt_ids=[1])
    tokens, reason = drain(decode, "t")
    assert tokens == [4, 5] and reason == FinishReason.ABORT
