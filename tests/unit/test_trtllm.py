"""The TensorRT-LLM adapters against a test double of `tensorrt_llm` (tests/fakes: it stands
for the GPU library, which cannot be installed here). What is checked is disagg's side of the
contract: context_only then generation_only with the same parameters, the hand-off bytes, the
token stream DecodeService sees, aborts and capacity."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path

import pytest

from disagg.engine.llm_engine import PrefillResult
from disagg.engine.sequence import FinishReason, SamplingParams
from disagg.errors import CapacityError, KVPayloadError, RequestError
from disagg.pipeline.decode_service import DecodeService
from disagg.trtllm import payload
from disagg.trtllm.engines import TrtllmDecodeEngine, TrtllmPrefillEngine
from disagg.trtllm.sampling import TrtllmApi

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
    assert kind == "generate_async"  # abortable: tests/unit/test_prefill_cancel.py
    assert (dp.request_type, sp.max_tokens, sp.seed) == ("context_only", 1, 11)
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

    def send(self, token_ids, finish_reason, num_cached_tokens=0, logprobs=None):
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
    from disagg.trtllm.sampling import trt_sampling

    api = TrtllmApi.load()
    greedy = trt_sampling(api, SamplingParams(temperature=0.0, top_p=0.9), seed=1)
    assert greedy.top_k == 1 and greedy.temperature is None and greedy._greedy_decoding
    sampled = trt_sampling(api, SamplingParams(temperature=0.7, top_p=0.9, top_k=40), seed=1)
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.7, 0.9, 40)
    assert not sampled._greedy_decoding


def test_bad_words_go_down_as_single_tokens_or_are_refused(trt):
    from disagg.trtllm.sampling import trt_sampling

    api = TrtllmApi.load()
    sp = trt_sampling(api, SamplingParams(bad_words_ids=((5,), (9,))), seed=1)
    assert sp.bad_token_ids == [5, 9]
    with pytest.raises(RequestError, match="longer than one token"):
        trt_sampling(api, SamplingParams(bad_words_ids=((5, 6),)), seed=1)
    prefill, _, _, _ = engines(trt)
    with pytest.raises(RequestError):  # the request's error, a 400: never silently dropped
        prefill.prefill("r", [1, 2], SamplingParams(bad_words_ids=((5, 6),)))


def test_penalties_and_min_tokens_go_down_by_their_names(trt):
    from disagg.trtllm.sampling import trt_sampling

    api = TrtllmApi.load()
    params = SamplingParams(
        max_tokens=8, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
        min_tokens=5,
    )  # fmt: skip
    sp = trt_sampling(api, params, seed=1)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.2)
    assert sp.min_tokens == 5
    assert trt_sampling(api, params, seed=1, max_tokens=1).min_tokens == 1  # prefill's call
    plain = trt_sampling(api, SamplingParams(), seed=1)
    assert plain.presence_penalty is plain.repetition_penalty is plain.min_tokens is None
    with pytest.raises(RequestError, match="logit_bias is not supported with TensorRT-LLM"):
        trt_sampling(api, SamplingParams(logit_bias=((3, -100.0),)), seed=1)


def test_guides_go_down_as_guided_decoding_params_where_the_pool_has_a_backend(trt):
    """Checked against the double of 1.0's GuidedDecodingParams (one guide per request)."""
    from disagg.trtllm.sampling import trt_sampling

    api = TrtllmApi.load()
    schema = '{"type": "object"}'
    for guide_type, guide, field, value in (
        ("json", "", "json_object", True),
        ("json_schema", schema, "json", schema),
        ("regex", "a+", "regex", "a+"),
        ("ebnf_grammar", 'root ::= "x"', "grammar", 'root ::= "x"'),
    ):
        params = SamplingParams(guide_type=guide_type, guide=guide)
        sp = trt_sampling(api, params, seed=1, guided_backend="xgrammar")
        assert getattr(sp.guided_decoding, field) == value, guide_type
    assert (
        trt_sampling(api, SamplingParams(), seed=1, guided_backend="xgrammar").guided_decoding
        is None
    )
    for params, words in (
        (SamplingParams(guide_type="json"), "needs guided_decoding_backend"),  # no backend
        (SamplingParams(guide_type="yaml", guide="a"), "not supported"),
        (SamplingParams(guide_type="json", guide_tokens=(1,)), "cannot be continued"),
    ):
        backend = None if "backend" in words else "llguidance"
        with pytest.raises(RequestError, match=words):
            trt_sampling(api, params, seed=1, guided_backend=backend)


def test_grammars_reach_each_backend_in_the_syntax_it_reads(trt):
    """1.0's llguidance matcher reads `grammar` as Lark (grammar_from_lark), xgrammar as
    EBNF: a GBNF grammar is converted for llguidance, a Lark one (a required tool call's)
    passes to llguidance as it is and is refused under xgrammar, naming the way out."""
    import llguidance

    from disagg.trtllm.sampling import trt_sampling

    api = TrtllmApi.load()
    gbnf = SamplingParams(guide_type="ebnf_grammar", guide='root ::= "x" | "yz"')
    lark = SamplingParams(guide_type="lark", guide='start: "<tool_call>" %json{"type": "object"}')
    to_ll = trt_sampling(api, gbnf, seed=1, guided_backend="llguidance").guided_decoding.grammar
    assert to_ll != gbnf.guide and "::=" not in to_ll
    ok, _ = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(to_ll), None
    )
    assert not ok  # (is_error False: upstream's grammar_from_lark takes what we send)
    sent = trt_sampling(api, lark, seed=1, guided_backend="llguidance").guided_decoding
    assert sent.grammar == lark.guide
    with pytest.raises(RequestError, match="guided_decoding_backend llguidance"):
        trt_sampling(api, lark, seed=1, guided_backend="xgrammar")


def test_prefill_draws_no_progress_bar(trt):
    # generate() draws one per call on the server's stderr unless use_tqdm=False;
    # generate_async (abortable: tests/unit/test_prefill_cancel.py) draws none
    prefill, _, prefill_llm, _ = engines(trt)
    prefill.prefill("r1", [1, 2, 3], SamplingParams(max_tokens=3))
    assert [c[0] for c in prefill_llm.calls] == ["generate_async"]


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


def test_a_prompt_found_in_the_prefix_cache_reports_its_reused_tokens(trt):
    """1.0's outputs carry no cached-token count: disagg asks for the request's perf metrics
    (where SamplingParams has the field) and counts reused blocks of 32 tokens."""
    prefill, decode, prefill_llm, _ = engines(trt)
    prompt = list(range(1, 61))  # a whole block of 32 tokens and 28 more
    first, _ = prefill.prefill("r1", prompt, SamplingParams(max_tokens=2))
    again, _ = prefill.prefill("r2", prompt[:32] + [9, 9], SamplingParams(max_tokens=2))
    assert (first.num_reused_tokens, again.num_reused_tokens) == (0, 32)
    assert prefill_llm.calls[-1][2].return_perf_metrics is True
    decode.add_request("c1", SamplingParams(max_tokens=3), prompt_ids=prompt)
    decode.add_request("c2", SamplingParams(max_tokens=3), prompt_ids=prompt[:40])
    firsts = {}
    while len(firsts) < 2:
        for o in decode.step(wait_s=1.0):
            if o.index == 0 and o.token_id is not None:
                firsts[o.request_id] = o.num_reused_tokens
    assert firsts == {"c1": 0, "c2": 32}  # another pool's cache; c2's first block was c1's
    api = TrtllmApi.load()
    plain = TrtllmPrefillEngine(trt.LLM("ckpt"), api, 64)
    plain.features = dataclasses.replace(plain.features, perf_metrics=False)  # a version without
    plain.prefill("p1", prompt, SamplingParams(max_tokens=2))
    result, _ = plain.prefill("p2", prompt, SamplingParams(max_tokens=2))
    assert result.num_reused_tokens == 0 and plain.llm.calls[-1][2].return_perf_metrics is False


def test_kv_cache_events_say_which_blocks_each_pool_stored_and_evicted(trt):
    api = TrtllmApi.load()
    kv = {"enable_block_reuse": True, "event_buffer_max_size": 16, "max_tokens": 128}
    prefill = TrtllmPrefillEngine(trt.LLM("ckpt", kv_cache_config=kv), api, 200)
    prefill.prefill("r1", list(range(100)), SamplingParams(max_tokens=1))  # 3 blocks of 4
    (stored,) = prefill.kv_cache_events()  # "created" says nothing of prefixes: skipped
    assert stored.kind == "stored" and len(stored.block_hashes) == 3
    assert stored.parent_hash is None  # a prefix from its start
    assert prefill.kv_cache_events() == []  # read once
    prefill.prefill("r2", list(range(64)) + [5] * 40, SamplingParams(max_tokens=1))
    (grown,) = prefill.kv_cache_events()  # two blocks reused, one more stored after them
    assert grown.parent_hash == stored.block_hashes[1] and len(grown.block_hashes) == 1
    prefill.prefill("r3", [7] * 40, SamplingParams(max_tokens=1))  # a fifth block: one goes
    new, removed = prefill.kv_cache_events()
    assert removed.kind == "removed" and removed.block_hashes == stored.block_hashes[2:]
    quiet = TrtllmDecodeEngine(trt.LLM("ckpt"), api, 2)  # no event buffer: none kept
    quiet.add_request("c", SamplingParams(max_tokens=2), prompt_ids=list(range(40)))
    drain(quiet, "c")
    assert quiet.kv_cache_events() == []


def test_a_context_nobody_collects_holds_its_blocks_until_the_transfer_times_out(trt):
    """Prefill timed out, decode prefilled itself, the client left: the context's KV stays
    on the prefill GPU. 1.0 has no timeout and an abort does not reach a finished context;
    where the library has kv_transfer_timeout_ms (runtime.py sets it) the blocks go."""
    prefill, decode, prefill_llm, _ = engines(trt)
    params = SamplingParams(max_tokens=4)
    prefill.prefill("lost", [1, 2, 3], params)
    context = trt.DisaggregatedParams(request_type="context_only")
    out = prefill_llm.generate([4, 5], trt.SamplingParams(), disaggregated_params=context)
    out.abort()
    assert prefill_llm.held_contexts() == 2  # 1.0: held, abort or not
    timed = trt.LLM("ckpt", cache_transceiver_config={"backend": "ucx"})
    timed.options["cache_transceiver_config"]["kv_transfer_timeout_ms"] = 50  # a later release
    late = TrtllmPrefillEngine(timed, TrtllmApi.load(), 64)
    result, handoff = late.prefill("slow", [7, 8], params)
    assert timed.held_contexts() == 1
    time.sleep(0.1)
    assert timed.held_contexts() == 0  # freed on the prefill GPU
    with pytest.raises(RuntimeError, match="KV cache transfer failed"):  # too late to collect
        decode.add_request("slow", params, prefill=PrefillResult("slow", 0, handoff, 1, 0))
    r, h = prefill.prefill("ok", [6], params)  # collected: freed at once
    decode.add_request("ok", params, prefill=PrefillResult("ok", r.first_token, h, h.seed, 0))
    drain(decode, "ok")
    assert prefill_llm.held_contexts() == 2


def test_the_cache_salt_goes_down_only_where_the_library_takes_one(trt):
    """The gateway salts each API key's prompts; 1.0's generate has no cache_salt (the
    double refuses it, as a TypeError), later ones do: there a request that may not use the
    cache gets a namespace of its own."""
    prefill, decode, prefill_llm, _ = engines(trt)
    salted = SamplingParams(max_tokens=2, cache_salt="key-a")
    prefill.prefill("r1", [1, 2], salted)  # no cache_salt keyword reached the 1.0 double
    assert not prefill.features.cache_salt

    class Salted(trt.LLM):
        def generate(self, inputs, sampling_params=None, use_tqdm=True,
                     disaggregated_params=None, cache_salt=None):  # fmt: skip
            self.salts = [*getattr(self, "salts", []), cache_salt]
            return super().generate(inputs, sampling_params, use_tqdm, disaggregated_params)

        def generate_async(self, inputs, sampling_params=None, streaming=False,
                           disaggregated_params=None, cache_salt=None):  # fmt: skip
            self.salts = [*getattr(self, "salts", []), cache_salt]
            return super().generate_async(inputs, sampling_params, streaming, disaggregated_params)

    llm = Salted("ckpt")
    engine = TrtllmPrefillEngine(llm, TrtllmApi.load(), 64)
    assert engine.features.cache_salt
    _, handoff = engine.prefill("r2", [1, 2], salted)
    engine.prefill("r3", [1, 2], SamplingParams(max_tokens=2, use_cache=False))
    engine.prefill("r4", [1, 2], SamplingParams(max_tokens=2))
    assert llm.salts == ["key-a", "no-reuse:r3", None]
    wire = payload.from_bytes(payload.to_bytes(handoff))  # the generation half: the same salt
    assert wire.cache_salt == "key-a"
    gen = TrtllmDecodeEngine(Salted("ckpt"), TrtllmApi.load(), 2)
    params = SamplingParams(max_tokens=2, cache_salt="key-a")
    gen.add_request("r2", params, prefill=PrefillResult("r2", 3, wire, wire.seed, 0))
    drain(gen, "r2")
    assert gen.llm.salts == ["key-a"]


def test_logprobs_go_down_as_top_logprobs_and_come_back_aligned_with_their_tokens(trt):
    """SamplingParams.logprobs asks 1.0 for top logprobs (at least 1: the token's own); its
    {token: Logprob(logprob, rank)} per token become TokenLogprobs. A generation_only
    output lacks the first token's (1.0): prefill's context request supplies it, and decode's
    tokens keep theirs (aligned from the end, not shifted by one)."""
    prefill, decode, prefill_llm, decode_llm = engines(trt)
    params = SamplingParams(max_tokens=5, logprobs=3, seed=1)
    result, handoff = prefill.prefill("r", [5, 6, 7], params)
    assert prefill_llm.calls[-1][2].logprobs == 3
    first = result.first_logprob
    assert first is not None and first.top[0][0] == result.first_token and len(first.top) == 3
    decode.add_request("r", params, prefill=PrefillResult("r", result.first_token, handoff, 1, 0))
    outputs = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(o.finish_reason for o in outputs):
        outputs += decode.step()
    tokens = [o for o in outputs if o.token_id is not None]
    assert len(tokens) == 4
    for o in tokens:
        assert o.logprob is not None and o.logprob.top[0] == (o.token_id, o.logprob.logprob)
        assert [v for _, v in o.logprob.top] == sorted((v for _, v in o.logprob.top), reverse=True)
    own = SamplingParams(max_tokens=2, logprobs=0)
    prefill.prefill("z", [1, 2], own)
    assert prefill_llm.calls[-1][2].logprobs == 1  # the token's own, without alternatives
    plain, _ = prefill.prefill("p", [1, 2], SamplingParams(max_tokens=2))
    assert prefill_llm.calls[-1][2].logprobs is None and plain.first_logprob is None
