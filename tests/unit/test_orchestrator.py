"""Orchestration logic with scripted pools (test doubles of the prefill and decode models) and
a stub tokenizer: no weights, no processes (tests/helpers/scripted.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers.scripted import (
    ScriptedDecode,
    ScriptedPrefill,
    StubTokenizer,
    model_args,
)

from disagg import contracts as C
from disagg.contracts import COLOCATED, CONDITIONAL, DISAGGREGATED, FALLBACK, DecodeStep
from disagg.engine.config import EngineConfig
from disagg.engine.sequence import SamplingParams
from disagg.errors import KVPayloadError, KVPrefixMissError, PoolError, RequestError
from disagg.pipeline.interfaces import OrchestratorEvents
from disagg.pipeline.orchestrator import Orchestrator
from disagg.pipeline.prefix_locality import PrefixLocality
from disagg.pipeline.request import GenerateRequest, build_request

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    return StubTokenizer()


@pytest.fixture(scope="module")
def args():
    return model_args()


def orchestrator(tokenizer, args, prefill, decode, mode=DISAGGREGATED):
    return Orchestrator(tokenizer, args, EngineConfig(max_model_len=2048), prefill, decode, mode)


def request(tokenizer, text="Hi", stream=True, **params) -> GenerateRequest:
    return GenerateRequest(
        "rid",
        tokenizer.encode(text),
        text,
        SamplingParams(**{"max_tokens": 16, **params}),
        stream=stream,
        exclude_input_in_output=True,
    )


def test_first_token_streams_before_decode_starts(tokenizer, args):
    ids = tokenizer.encode(" Hello world, how are you")
    log = []
    decode = ScriptedDecode(ids[1:], log=log)
    o = orchestrator(tokenizer, args, ScriptedPrefill(ids[0]), decode)
    deltas = []
    final = o.run(request(tokenizer), emit=lambda r: (log.append("emit"), deltas.append(r.text)))
    assert log[:2] == ["emit", "decode"]  # TTFT does not wait for decode
    assert "".join(deltas) + final.text == " Hello world, how are you"
    assert (final.served_by, final.prefill_pid, final.decode_pid) == (DISAGGREGATED, 111, 222)
    assert final.num_output_tokens == len(ids) and final.finish_reason == "length"
    handoff, prompt_ids = decode.calls[0]
    assert handoff.first_token == ids[0]
    assert prompt_ids == tokenizer.encode("Hi")  # names the handed-off K/V, for its cache


def test_prefill_pool_failure_falls_back_to_decode_prefill(tokenizer, args):
    prefill = ScriptedPrefill(error=PoolError("prefill: Stub process is not healthy"))
    decode = ScriptedDecode(tokenizer.encode(" fine"))
    final = orchestrator(tokenizer, args, prefill, decode).run(request(tokenizer), lambda r: None)
    assert final.served_by == FALLBACK and final.finish_reason == "length"
    handoff, prompt_ids = decode.calls[0]
    assert handoff is None and prompt_ids == tokenizer.encode("Hi")


def test_request_errors_from_prefill_are_not_retried(tokenizer, args):
    decode = ScriptedDecode([5])
    o = orchestrator(tokenizer, args, ScriptedPrefill(error=RequestError("bad seed")), decode)
    with pytest.raises(RequestError, match="bad seed"):
        o.run(request(tokenizer), lambda r: None)
    assert decode.calls == []


def test_colocated_mode_skips_the_prefill_pool(tokenizer, args):
    prefill, decode = ScriptedPrefill(5), ScriptedDecode([5])
    final = orchestrator(tokenizer, args, prefill, decode, COLOCATED).run(
        request(tokenizer), lambda r: None
    )
    assert prefill.calls == [] and final.served_by == COLOCATED


def test_stop_string_cancels_decode_and_cuts_the_text(tokenizer, args):
    ids = tokenizer.encode(" one two STOP three four")
    decode = ScriptedDecode(ids[1:])
    final = orchestrator(tokenizer, args, ScriptedPrefill(ids[0]), decode).run(
        request(tokenizer, stream=False, stop=("STOP",)), lambda r: None
    )
    assert final.text == " one two " and final.finish_reason == "stop"
    assert decode.cancelled == ["rid"]


def test_client_cancel_reaches_decode(tokenizer, args):
    ids = tokenizer.encode(" a b c d e f")
    decode = ScriptedDecode(ids[1:])
    final = orchestrator(tokenizer, args, ScriptedPrefill(ids[0]), decode).run(
        request(tokenizer), lambda r: None, is_cancelled=lambda: bool(decode.calls)
    )  # (cancelled once decode has it; before: tests/unit/test_prefill_cancel.py)
    assert final.finish_reason == "abort" and decode.cancelled == ["rid"]


def test_a_hand_off_decode_never_took_is_released_when_the_client_goes(
    tokenizer, args, monkeypatch
):
    # (the lease on a prefill server would otherwise wait for its TTL: a CI run saw 83 MB)
    released = []
    monkeypatch.setattr("disagg.pipeline.request.release", released.append)
    ids = tokenizer.encode(" a b c")
    decode = ScriptedDecode(ids[1:])

    def gone(reply):
        raise ConnectionError("the client went away")

    o = orchestrator(tokenizer, args, ScriptedPrefill(ids[0]), decode)
    with pytest.raises(ConnectionError):
        o.run(request(tokenizer), emit=gone)  # sending the first token fails
    assert len(released) == 1 and decode.calls == []
    # once decode acknowledged it (it took the payload), nothing is left to release
    final = o.run(request(tokenizer), lambda r: None, is_cancelled=lambda: bool(decode.calls))
    assert final.finish_reason == "abort" and len(released) == 1


def test_decode_stream_without_an_end_is_a_pool_error(tokenizer, args):
    o = orchestrator(tokenizer, args, ScriptedPrefill(5), ScriptedDecode([6], finish=None))
    with pytest.raises(PoolError, match="without a finish reason"):
        o.run(request(tokenizer), lambda r: None)


def test_non_streaming_reply_can_echo_the_prompt(tokenizer, args):
    ids = tokenizer.encode(" there")
    o = orchestrator(tokenizer, args, ScriptedPrefill(ids[0]), ScriptedDecode(ids[1:]))
    req = request(tokenizer, text="Hello", stream=False)
    echo = GenerateRequest(**{**req.__dict__, "exclude_input_in_output": False})
    assert o.run(echo, lambda r: None).text == "Hello there"
    assert o.run(req, lambda r: None).text == " there"


def test_bad_requests_are_refused_before_any_pool_works(tokenizer, args):
    prefill, decode = ScriptedPrefill(5), ScriptedDecode([5])
    o = orchestrator(tokenizer, args, prefill, decode)
    with pytest.raises(RequestError, match="prompt is empty"):
        o.run(GenerateRequest("r", [], "", SamplingParams()), lambda r: None)
    assert prefill.calls == [] and decode.calls == []


def test_build_request_maps_trtllm_fields(tokenizer):
    req = build_request(
        {
            C.INPUT_IDS: [1, 2],
            C.TEXT_INPUT: "x",
            C.MAX_TOKENS: 9,
            C.TEMPERATURE: 0.5,
            C.STOP_WORDS: ["", "END"],
            C.BAD_WORDS: ["", "bad"],
            C.END_ID: 7,
            C.SEED: 3,
            C.STREAM: True,
        },
        tokenizer,
        max_tokens_default=128,
    )
    p = req.params
    assert (p.max_tokens, p.temperature, p.seed, p.stop, p.stop_token_ids) == (
        9,
        0.5,
        3,
        ("END",),
        (7,),
    )
    assert p.bad_words_ids == (tuple(tokenizer.encode("bad")),) and req.stream
    default = build_request({C.INPUT_IDS: [1]}, tokenizer, max_tokens_default=128)
    assert default.params.max_tokens == 128 and not default.stream


class Recorder(OrchestratorEvents):
    """Records the metric hooks the orchestrator calls."""

    def __init__(self):
        self.calls = []

    def first_token(self, served_by, ttft_s):
        self.calls.append(("first_token", served_by))

    def token_gap(self, served_by, itl_s, num_tokens):
        self.calls.extend([("token_gap", served_by)] * num_tokens)

    def finished(self, served_by, finish_reason, e2e_s):
        self.calls.append(("finished", served_by, finish_reason))

    def kv_handoff(self, num_bytes, seconds, path):
        self.calls.append(("kv_handoff", num_bytes))

    def decision(self, remote, reason, estimates):
        self.calls.append(("decision", remote, reason))
        self.estimates = dict(estimates)

    def kv_handoff_skipped(self, num_bytes):
        self.calls.append(("kv_handoff_skipped", num_bytes))

    def kv_prefix_miss(self):
        self.calls.append(("kv_prefix_miss",))

    def names(self, name):
        return [c for c in self.calls if c[0] == name]


def test_conditional_mode_follows_its_cost_model(tokenizer, args):
    events = Recorder()
    prefill, decode = ScriptedPrefill(5), ScriptedDecode([6, 7, 8])
    o = Orchestrator(
        tokenizer, args, EngineConfig(max_model_len=2048), prefill, decode, CONDITIONAL, events
    )
    short = request(tokenizer, "Hi")
    o.run(short, lambda r: None)  # nothing decoding: decode prefills it
    assert prefill.calls == [] and decode.calls[-1][1] == short.prompt_ids
    assert events.names("decision") == [("decision", False, "decode_idle")]
    o.load.add_decode(4)  # four sequences decoding: a long prompt would stall them
    long = request(tokenizer, "word " * 600)
    final = o.run(long, lambda r: None)
    assert final.served_by == DISAGGREGATED and prefill.calls == [long.prompt_ids]
    assert events.names("decision")[-1] == ("decision", True, "protect_decode")
    assert events.names("kv_handoff") == [("kv_handoff", 16)]
    # the estimates it was decided with (the hand-off it then saw moved one of them since)
    assert events.estimates.keys() == o.cost_model.estimates().keys()
    assert events.estimates["remote_stall"] == o.cost_model.remote_stall
    assert o.load.snapshot().local_queue_tokens == 0  # the local prefill's first token came


def test_conditional_mode_sends_a_prompt_where_its_prefix_is_cached(tokenizer, args):
    """Four sequences decoding would send a long prompt to the prefill pool, unless decode
    holds most of it: the orchestrator recorded where the first turn's blocks were left."""
    events = Recorder()
    prefill, decode = ScriptedPrefill(5), ScriptedDecode([6, 7, 8])
    o = Orchestrator(
        tokenizer, args, EngineConfig(max_model_len=2048), prefill, decode, CONDITIONAL,
        events, locality=PrefixLocality(4096),
    )  # fmt: skip
    turn1 = request(tokenizer, "word " * 600)
    assert o.run(turn1, lambda r: None).served_by == COLOCATED  # decode idle: prefilled there
    o.load.add_decode(4)
    turn2 = request(tokenizer, "word " * 600 + "and one more question")
    assert o.run(turn2, lambda r: None).served_by == COLOCATED  # decode kept turn 1
    assert events.names("decision")[-1] == ("decision", False, "prefix_cached")
    other_key = GenerateRequest(**{**turn2.__dict__, "params": SamplingParams(
        max_tokens=16, cache_salt="another key")})  # fmt: skip
    assert o.run(other_key, lambda r: None).served_by == DISAGGREGATED  # not its blocks


def test_every_token_is_timed_once(tokenizer, args):
    events = Recorder()
    o = Orchestrator(
        tokenizer,
        args,
        EngineConfig(max_model_len=2048),
        ScriptedPrefill(5),
        ScriptedDecode([6, 7, 8, 9]),
        events=events,
    )
    final = o.run(request(tokenizer), lambda r: None)
    assert final.num_output_tokens == 5
    assert events.names("first_token") == [("first_token", DISAGGREGATED)]
    assert len(events.names("token_gap")) == 4  # every token after the first
    assert events.names("finished") == [("finished", DISAGGREGATED, "length")]


class FailingReplicas:
    """Decode replicas that each fail after `fail_after` tokens (until `failures` run out):
    a replica continues from the prompt plus every token already produced."""

    def __init__(self, reply: list[int], fail_after: int, failures: int) -> None:
        self.reply, self.fail_after, self.failures = reply, fail_after, failures
        self.calls = []

    def generate(self, request_id, params, *, handoff=None, prompt_ids=None):
        self.calls.append((request_id, handoff, prompt_ids, params.max_tokens))
        done = 1 if handoff is not None else len(prompt_ids) - self.prompt_len
        yield DecodeStep([], None, 300 + len(self.calls))
        for n, t in enumerate(self.reply[done:]):
            if self.failures and n == self.fail_after:
                self.failures -= 1
                raise PoolError("decode at 10.0.0.9:8001: decode worker unreachable mid-request")
            last = done + n == len(self.reply) - 1
            yield DecodeStep([t], "length" if last else None, 300 + len(self.calls))

    def cancel(self, request_id):
        pass


def migrating(tokenizer, args, text: str, fail_after: int, failures: int, limit: int):
    ids = tokenizer.encode(text)
    prompt = request(tokenizer, "Count", max_tokens=len(ids))
    decode = FailingReplicas(ids, fail_after, failures)
    decode.prompt_len = len(prompt.prompt_ids)
    config = EngineConfig(max_model_len=2048)
    o = Orchestrator(
        tokenizer, args, config, ScriptedPrefill(ids[0]), decode, migration_limit=limit
    )
    return o, ids, prompt, decode


def test_a_decode_replica_failing_mid_stream_moves_the_request_to_another(tokenizer, args):
    text = " one two three four five six seven eight"
    o, ids, prompt, decode = migrating(tokenizer, args, text, fail_after=3, failures=2, limit=2)
    deltas = []
    final = o.run(prompt, emit=lambda r: deltas.append(r.text))
    # one stream, nothing repeated or lost: the same text as an undisturbed run
    assert "".join(deltas) + final.text == text
    assert final.token_ids == ids and final.finish_reason == "length"
    (rid0, h0, p0, _), (rid1, h1, p1, left1), (rid2, _, p2, left2) = decode.calls
    assert h0 is not None and p0 == prompt.prompt_ids  # the first replica got the hand-off
    assert h1 is None and p1 == prompt.prompt_ids + ids[:4]  # then prompt + tokens so far
    assert left1 == len(ids) - 4 and p2 == prompt.prompt_ids + ids[:7] and left2 == 1
    assert len({rid0, rid1, rid2}) == 3 and rid1.startswith(rid0 + ".")  # cancellable as one
    assert final.decode_pid == 303


def test_migration_gives_up_after_its_limit(tokenizer, args):
    o, _, prompt, decode = migrating(
        tokenizer, args, " a b c d e", fail_after=1, failures=5, limit=1
    )
    with pytest.raises(PoolError, match="unreachable"):
        o.run(prompt, emit=lambda r: None)
    assert len(decode.calls) == 2


def test_the_kv_path_is_told_from_the_payload():
    from disagg.kvnet import KVRef
    from disagg.pipeline.handoff import kv_path
    from disagg.trtllm.payload import TrtllmHandoff, to_bytes

    ref = np.frombuffer(KVRef("10.0.0.5:8105", "ab" * 16, 13_800_000).to_bytes(), np.uint8)
    assert kv_path(ref) == ("network", 13_800_000)  # the bytes pulled, not the reference's
    trt = np.frombuffer(to_bytes(TrtllmHandoff([1, 2], 3, {"ctx_request_id": 9})), np.uint8)
    assert kv_path(trt)[0] == "trtllm"
    assert kv_path(np.zeros(4096, np.uint8)) == ("shm", 4096)


# ------------------------------------------------------------------ hand-offs of what decode lacks


class PrefixMissingDecode(ScriptedDecode):
    """A decode pool that no longer holds the prefix a partial hand-off left out (evicted or
    restarted): as the decode model over BLS, it acknowledges, then fails with the kind."""

    def generate(self, request_id, params, *, handoff=None, prompt_ids=None):
        if handoff is not None and handoff.kv_start:
            self.calls.append((handoff, prompt_ids))
            yield DecodeStep([], None, 222)
            raise KVPrefixMissError("decode: decode's prefix cache holds 0 of the 32 tokens")
        yield from super().generate(request_id, params, handoff=handoff, prompt_ids=prompt_ids)


class ResamplingPrefill(ScriptedPrefill):
    """Each prefill samples another first token (a temperature above 0)."""

    def prefill(self, request_id, prompt_ids, params, skip_tokens=0):
        handoff = super().prefill(request_id, prompt_ids, params, skip_tokens)
        return dataclasses.replace(handoff, first_token=handoff.first_token + len(self.calls))


def two_turns(tokenizer, args, decode, prefill=None, **params):
    """An orchestrator that served turn 1 (decode kept its prompt and reply), and turn 2."""
    events, prefill = Recorder(), prefill or ScriptedPrefill(5)
    o = Orchestrator(
        tokenizer, args, EngineConfig(max_model_len=2048), prefill, decode, DISAGGREGATED,
        events, locality=PrefixLocality(4096),
    )  # fmt: skip
    turn1 = request(tokenizer, "word " * 40, **params)
    reply1 = o.run(turn1, lambda r: None).token_ids
    turn2 = dataclasses.replace(
        turn1, prompt_ids=turn1.prompt_ids + reply1 + tokenizer.encode(" and one more")
    )
    return o, events, prefill, turn1, reply1, turn2


def test_a_hand_off_leaves_out_the_whole_blocks_decode_kept(tokenizer, args):
    decode = ScriptedDecode([6, 7, 8])
    o, events, prefill, turn1, reply1, turn2 = two_turns(tokenizer, args, decode)
    final = o.run(turn2, lambda r: None)
    kept = len(turn1.prompt_ids) + len(reply1) - 1  # the last token has no K/V in decode
    skip = kept // 16 * 16
    assert skip >= 32 and prefill.skips == [0, skip]
    handoff, prompt_ids = decode.calls[-1]
    assert handoff.kv_start == skip and prompt_ids == turn2.prompt_ids  # names the prefix
    assert final.token_ids == reply1  # the same reply as a whole hand-off gives here
    assert events.names("kv_handoff_skipped") == [("kv_handoff_skipped", skip * 46080)]
    assert events.names("kv_prefix_miss") == []


def test_a_skip_never_takes_the_last_prompt_token_or_another_keys_blocks(tokenizer, args):
    from disagg.pipeline.handoff import skip_tokens

    assert skip_tokens(64, 64, 16) == 48 and skip_tokens(64, 65, 16) == 64
    assert skip_tokens(40, 100, 16) == 32 and skip_tokens(0, 1, 16) == 0
    decode = ScriptedDecode([6, 7, 8])
    o, _, prefill, _, _, turn2 = two_turns(tokenizer, args, decode)
    o.run(dataclasses.replace(turn2, params=SamplingParams(max_tokens=16, cache_salt="k2")),
          lambda r: None)  # fmt: skip
    o.run(dataclasses.replace(turn2, params=SamplingParams(max_tokens=16, use_cache=False)),
          lambda r: None)  # fmt: skip
    assert prefill.skips[-2:] == [0, 0]  # not that key's blocks; a request bypassing caches


def test_decode_missing_the_prefix_gets_the_whole_prompt_and_the_reply_is_the_same(tokenizer, args):
    decode = PrefixMissingDecode([6, 7, 8])
    prefill = ResamplingPrefill(5)
    o, events, prefill, turn1, reply1, turn2 = two_turns(tokenizer, args, decode, prefill)
    deltas = []
    final = o.run(turn2, lambda r: deltas.append(r.text))
    (partial, _), (whole, prompt_ids) = decode.calls[-2:]
    assert partial.kv_start > 0 and prefill.skips[-2:] == [partial.kv_start, 0]
    assert whole.kv_start == 0 and prompt_ids == turn2.prompt_ids
    # decode continues from the first token already streamed (the resend sampled another)
    assert whole.first_token == partial.first_token == final.token_ids[0]
    assert final.token_ids == [partial.first_token, 6, 7, 8] and final.finish_reason == "length"
    assert "".join(deltas) + final.text == tokenizer.decode(final.token_ids)
    assert events.names("kv_prefix_miss") == [("kv_prefix_miss",)]
    assert events.names("kv_handoff_skipped") == []  # nothing was left out in the end
    assert decode.cancelled == []  # decode refused the partial one: nothing to stop


def test_a_resend_whose_prefill_fails_is_prefilled_by_decode_and_completes(tokenizer, args):
    decode = PrefixMissingDecode([6, 7, 8])
    o, events, prefill, _, _, turn2 = two_turns(tokenizer, args, decode)
    partial = prefill.prefill

    def only_once(request_id, prompt_ids, params, skip_tokens=0):
        prefill.prefill = ScriptedPrefill(error=PoolError("prefill: not healthy")).prefill
        return partial(request_id, prompt_ids, params, skip_tokens)

    prefill.prefill = only_once
    deltas = []
    final = o.run(turn2, lambda r: deltas.append(r.text))
    first = final.token_ids[0]
    handoff, prompt_ids = decode.calls[-1]
    # decode prefills the prompt and the first token already streamed, and goes on from it
    assert handoff is None and prompt_ids == turn2.prompt_ids + [first]
    assert final.token_ids[1:4] == [6, 7, 8]
    assert "".join(deltas) + final.text == tokenizer.decode(final.token_ids)
    assert final.finish_reason == "length" and events.names("kv_prefix_miss")


class PlacingDecode(ScriptedDecode):
    """Decode on other servers (remote/pools.py GrpcDecodePool): a replica is placed for the
    request before its prefill, and says how much of the prompt it surely holds."""

    def __init__(self, *a, holds: int = 0, **kw):
        super().__init__(*a, **kw)
        self.holds = holds
        self.placed: list[str] = []

    def place(self, request_id, prompt_ids, params):
        self.placed.append(request_id)
        return self.holds


def test_decode_on_another_server_gets_a_partial_hand_off_of_what_its_replica_holds(
    tokenizer, args
):
    prefill, decode = ScriptedPrefill(5), PlacingDecode([6, 7], holds=40)
    o = orchestrator(tokenizer, args, prefill, decode)  # no locality: the pools are remote
    req = request(tokenizer, "word " * 60)
    final = o.run(req, lambda r: None)
    assert decode.placed == ["rid"] and prefill.skips == [32]  # whole blocks it holds
    handoff, prompt_ids = decode.calls[0]
    assert handoff.kv_start == 32 and prompt_ids == req.prompt_ids
    assert final.token_ids == [5, 6, 7]
    decode.holds = 0
    o.run(req, lambda r: None)
    assert prefill.skips[-1] == 0


class UnpullableDecode(ScriptedDecode):
    """A decode pool whose pull of the hand-off fails (the lease expired, the bytes arrived
    damaged): it refuses the request with the kind, before any token."""

    def generate(self, request_id, params, *, handoff=None, prompt_ids=None):
        if handoff is not None:
            self.calls.append((handoff, prompt_ids))
            raise KVPayloadError("decode: KV lease ab12 not held (expired after 30 s)")
        yield from super().generate(request_id, params, handoff=handoff, prompt_ids=prompt_ids)


def test_a_hand_off_that_cannot_be_pulled_is_prefilled_by_decode_not_refused(tokenizer, args):
    """Not the client's error (it was a 400 before): decode prefills the prompt and the first
    token already sent, and the stream goes on."""
    ids = tokenizer.encode(" Hello world, how are you")
    decode = UnpullableDecode(ids[1:])
    o = orchestrator(tokenizer, args, ScriptedPrefill(ids[0]), decode)
    deltas = []
    final = o.run(request(tokenizer, max_tokens=len(ids)), lambda r: deltas.append(r.text))
    (failed, _), (none, prompt_ids) = decode.calls
    assert failed is not None and none is None  # the second try carries no hand-off
    assert prompt_ids[-1] == ids[0]  # the prompt plus the first token already streamed
    assert final.token_ids == ids and final.served_by == FALLBACK
    assert "".join(deltas) + final.text == tokenizer.decode(ids)
    kind, _ = C.split_error(C.tag_error(C.error_kind_of(KVPayloadError("x")), "x"))
    assert kind is C.ErrorKind.KV_TRANSFER  # and it travels between models as its own kind
    assert isinstance(C.error_from_kind(kind, "m", "decode"), KVPayloadError)


def test_a_logprob_of_minus_infinity_is_openais_minus_9999(tokenizer):
    from disagg.engine.sequence import TokenLogprob
    from disagg.pipeline.request import logprob_object

    class Bytes:
        def token_bytes(self, t):
            return b"x"

    obj = logprob_object(Bytes(), 5, TokenLogprob(float("-inf"), ((5, float("-inf")),)))
    assert obj["logprob"] == -9999.0 and obj["top_logprobs"][0]["logprob"] == -9999.0


class RefusingDecode(ScriptedDecode):
    """A decode replica that fails before it acknowledges (unreachable, its stub gone): the
    hand-off it never took is released before the request moves on."""

    def generate(self, request_id, params, *, handoff=None, prompt_ids=None):
        if handoff is not None:
            self.calls.append((handoff, prompt_ids))
            raise PoolError("decode: unreachable")
        yield from super().generate(request_id, params, handoff=handoff, prompt_ids=prompt_ids)


@pytest.mark.parametrize("decode_cls", [RefusingDecode, UnpullableDecode])
def test_a_hand_off_left_behind_by_a_failed_decode_is_released(
    tokenizer, args, monkeypatch, decode_cls
):
    released = []
    monkeypatch.setattr("disagg.pipeline.request.release", released.append)
    ids = tokenizer.encode(" Hello world, how are you")
    decode = decode_cls(ids[1:])
    o = orchestrator(tokenizer, args, ScriptedPrefill(ids[0]), decode)
    if decode_cls is RefusingDecode:  # (no migration here: the request fails, clearly)
        with pytest.raises(PoolError, match="unreachable"):
            o.run(request(tokenizer, max_tokens=len(ids)), lambda r: None)
    else:  # decode prefills it itself and the request goes on
        final = o.run(request(tokenizer, max_tokens=len(ids)), lambda r: None)
        assert final.token_ids == ids
    assert len(released) == 1 and released[0] is decode.calls[0][0].kv_payload
