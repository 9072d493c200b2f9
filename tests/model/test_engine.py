"""Prefill/decode split, KV hand-off, continuous batching and request errors on the real model."""

import multiprocessing as mp

import pytest

from disagg.engine.config import EngineConfig
from disagg.engine.kv_payload import KVPayload
from disagg.engine.llm_engine import DecodeEngine, PrefillEngine
from disagg.engine.sequence import FinishReason, SamplingParams
from disagg.errors import CapacityError, KVPayloadError, RequestError

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=24)
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the ocean and the moon, in four lines.",
    "List three prime numbers.",
    "Explain in one sentence why the sky is blue, please, for a child of six years.",
    "Translate 'good morning' into Spanish.",
]


def decode_alone(llm, prompt_ids, params=GREEDY) -> list[int]:
    """The reference: one request, nothing else in the engine, co-located."""
    engine = DecodeEngine(llm.model, llm.config, {llm.tokenizer.eos_token_id})
    engine.add_request("alone", params, prompt_ids=prompt_ids)
    out = []
    while engine.has_unfinished:
        out += [o.token_id for o in engine.step() if o.token_id is not None]
    return out


@pytest.fixture(scope="module")
def alone(llm):
    return {p: decode_alone(llm, llm.encode(p)) for p in PROMPTS}


def test_greedy_reply_is_sensible(llm):
    (c,) = llm.generate(
        ["What is the capital of France? Answer in one word."], SamplingParams(max_tokens=16)
    )
    assert "Paris" in c.text and c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_disaggregated_equals_colocated(llm, alone):
    comps = llm.generate(PROMPTS[:2], GREEDY)
    for p, c in zip(PROMPTS, comps, strict=False):
        assert c.token_ids[: len(alone[p])] == alone[p]
        assert c.text == llm.tokenizer.decode(
            [t for t in c.token_ids if t != llm.tokenizer.eos_token_id]
        )


def _prefill_in_child(engine_dir: str, prompt_ids: list[int], conn) -> None:
    import os

    from disagg.llm import LLM

    llm = LLM(engine_dir)
    r = llm.prefill_engine.prefill("x", prompt_ids, GREEDY)
    conn.send((os.getpid(), r.first_token, r.seed, r.kv.to_bytes()))
    conn.close()


def test_prefill_in_another_process_gives_the_same_tokens(llm, engine_dir, alone):
    import os

    from disagg.engine.llm_engine import PrefillResult

    ids = llm.encode(PROMPTS[1])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_in_child, args=(str(engine_dir), ids, child))
    proc.start()
    pid, first, seed, data = parent.recv()
    proc.join(timeout=60)
    assert pid != os.getpid() and proc.exitcode == 0
    kv = KVPayload.from_bytes(data)
    assert kv.num_tokens == len(ids)
    engine = DecodeEngine(llm.model, llm.config, {llm.tokenizer.eos_token_id})
    engine.add_request("r", GREEDY, prefill=PrefillResult("r", first, kv, seed, 0.0))
    out = [first]
    while engine.has_unfinished:
        out += [o.token_id for o in engine.step() if o.token_id is not None]
    assert out == alone[PROMPTS[1]]


def test_continuous_batch_with_staggered_joins_equals_each_alone(llm, alone):
    engine = DecodeEngine(llm.model, llm.config, {llm.tokenizer.eos_token_id})
    prefill = PrefillEngine(llm.model, llm.config)
    joins = {0: [0, 1], 3: [2], 5: [3], 9: [4]}  # step -> prompts joining before it
    got = {i: [] for i in range(len(PROMPTS))}
    batch_sizes = []
    step = 0
    while step <= max(joins) or engine.has_unfinished:
        for i in joins.get(step, []):
            r = prefill.prefill(str(i), llm.encode(PROMPTS[i]), GREEDY)
            got[i].append(r.first_token)
            engine.add_request(str(i), GREEDY, prefill=r)
        for o in engine.step():
            if o.token_id is not None:
                got[int(o.request_id)].append(o.token_id)
        batch_sizes.append(engine.stats().num_running)
        step += 1
    assert max(batch_sizes) >= 4  # they really ran together
    for i, p in enumerate(PROMPTS):
        assert got[i] == alone[p], f"prompt {i} diverged in the batch"


def test_admission_waits_when_the_batch_is_full(llm, alone):
    small = EngineConfig(max_num_seqs=2, max_model_len=llm.config.max_model_len)
    engine = DecodeEngine(llm.model, small, {llm.tokenizer.eos_token_id})
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), GREEDY, prompt_ids=llm.encode(p))
    got = {i: [] for i in range(len(PROMPTS))}
    while engine.has_unfinished:
        assert engine.stats().num_running <= 2
        for o in engine.step():
            if o.token_id is not None:
                got[int(o.request_id)].append(o.token_id)
    assert [got[i] for i in range(len(PROMPTS))] == [alone[p] for p in PROMPTS]
    assert engine.stats().num_kv_blocks_used == 0


def test_full_queue_is_refused_clearly(llm):
    tiny = EngineConfig(max_num_seqs=1, max_model_len=256, max_queue=1)
    engine = DecodeEngine(llm.model, tiny, {llm.tokenizer.eos_token_id})
    engine.add_request("a", GREEDY, prompt_ids=[1, 2, 3])
    with pytest.raises(CapacityError):
        engine.add_request("b", GREEDY, prompt_ids=[1, 2, 3])


def test_abort_frees_the_slot_and_reports_it(llm):
    engine = DecodeEngine(llm.model, llm.config, {llm.tokenizer.eos_token_id})
    engine.add_request("a", SamplingParams(max_tokens=50, ignore_eos=True), prompt_ids=[1, 2, 3])
    engine.add_request("b", SamplingParams(max_tokens=50, ignore_eos=True), prompt_ids=[4, 5, 6])
    engine.step()
    engine.finish_request("a")
    outs = engine.step()
    assert any(o.request_id == "a" and o.finish_reason is FinishReason.ABORT for o in outs)
    assert engine.stats().num_running == 1
    engine.finish_request("b")
    engine.step()
    assert not engine.has_unfinished and engine.stats().num_kv_blocks_used == 0


def test_seeded_sampling_is_the_same_disaggregated_and_colocated(llm):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    ids = llm.encode("Tell me a story about a robot.")
    colocated = decode_alone(llm, ids, params)
    (c,) = llm.generate([ids], params)
    assert c.token_ids == colocated
    other = decode_alone(llm, ids, SamplingParams(max_tokens=20, temperature=0.9, seed=99))
    assert other != colocated


def test_max_tokens_and_stop_strings(llm):
    (c,) = llm.generate(
        ["Count from 1 to 20, separated by commas."], SamplingParams(max_tokens=5, ignore_eos=True)
    )
    assert len(c.token_ids) == 5 and c.finish_reason is FinishReason.LENGTH
    (full,) = llm.generate(
        ["Count from 1 to 20, separated by commas."], SamplingParams(max_tokens=40)
    )
    assert "5" in full.text
    (c,) = llm.generate(
        ["Count from 1 to 20, separated by commas."], SamplingParams(max_tokens=40, stop=("5",))
    )
    assert c.finish_reason is FinishReason.STOP and c.text == full.text.split("5")[0]


def test_streamed_deltas_equal_the_full_text(llm):
    params = SamplingParams(max_tokens=30)
    deltas = list(llm.stream("Say hello in Chinese and add an emoji.", params))
    (c,) = llm.generate(["Say hello in Chinese and add an emoji."], params)
    assert "".join(deltas) == c.text and len(deltas) > 1


@pytest.mark.parametrize(
    "prompt_ids, params, msg",
    [
        ([], GREEDY, "prompt is empty"),
        ([1] * 3000, GREEDY, "context limit"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=2047), "context limit"),
        ([1, 99999], GREEDY, "token ids"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
    ],
)
def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(llm, prompt_ids, params, msg):
    with pytest.raises(RequestError, match=msg):
        llm.prefill_engine.prefill("bad", prompt_ids, params)
    with pytest.raises(RequestError, match=msg):
        llm.decode_engine.add_request("bad", params, prompt_ids=prompt_ids)
    assert not llm.decode_engine.has_unfinished
    (c,) = llm.generate(["Hi"], SamplingParams(max_tokens=3))
    assert c.token_ids


def test_kv_payload_for_another_model_is_refused(llm):
    r = llm.prefill_engine.prefill("x", [1, 2, 3], GREEDY)
    forged = KVPayload(**{**r.kv.__dict__, "fingerprint": "0" * 64})
    from disagg.engine.llm_engine import PrefillResult

    with pytest.raises(KVPayloadError, match="is for model"):
        llm.decode_engine.add_request(
            "x", GREEDY, prefill=PrefillResult("x", r.first_token, forged, r.seed, 0.0)
        )


def test_duplicate_request_id_is_refused(llm):
    engine = DecodeEngine(llm.model, llm.config, {llm.tokenizer.eos_token_id})
    engine.add_request("same", GREEDY, prompt_ids=[1, 2])
    with pytest.raises(RequestError, match="already in flight"):
        engine.add_request("same", GREEDY, prompt_ids=[1, 2])
