"""A decode that fails under a request on one server (pipeline/recovery.py): the other
instance continues the stream at once, or the orchestrator holds it until the restarted
decode takes it, within decode_recover_s. Scripted pools, no processes."""

from __future__ import annotations

import time

import pytest
from helpers.scripted import ScriptedPrefill, StubTokenizer, model_args

from disagg.contracts import DecodeStep
from disagg.engine.config import EngineConfig
from disagg.engine.sequence import SamplingParams
from disagg.errors import PoolError, RequestError
from disagg.pipeline.orchestrator import Orchestrator
from disagg.pipeline.recovery import DecodeRecovery
from disagg.pipeline.request import GenerateRequest

pytestmark = pytest.mark.unit
TEXT = " one two three four five six seven eight"
DIED = "decode worker 222 died mid-request"
NOT_READY = "decode: Request for unknown model: 'decode' has no available versions"
UNHEALTHY = "decode: Stub process 'decode_0_0' is not healthy."


class RestartingDecode:
    """This server's decode pool as the orchestrator sees it through a crash: each call takes
    the next script entry, ("serve", n) (acknowledge, then n tokens and die; None: to the
    end) or ("refuse", message) (fail before any response: the model is restarting, or
    Triton handed the call to the dead instance). A call continues from the prompt plus the
    tokens it is given, as decode does."""

    def __init__(self, reply: list[int], prompt_len: int, script: list[tuple]) -> None:
        self.reply, self.prompt_len, self.script = reply, prompt_len, list(script)
        self.calls: list[tuple] = []  # (request id, handoff, prompt ids, max_tokens, time)

    def generate(self, request_id, params, *, handoff=None, prompt_ids=None):
        self.calls.append((request_id, handoff, prompt_ids, params.max_tokens, time.monotonic()))
        what, arg = self.script.pop(0) if self.script else ("serve", None)
        if what == "refuse":
            raise PoolError(arg)
        yield DecodeStep([], None, 200 + len(self.calls))  # acknowledgement
        done = 1 if handoff is not None else len(prompt_ids) - self.prompt_len
        for n, t in enumerate(self.reply[done:]):
            if n == arg:
                raise PoolError(DIED)
            last = done + n == len(self.reply) - 1
            yield DecodeStep([t], "length" if last else None, 200 + len(self.calls))

    def cancel(self, request_id):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return StubTokenizer()


def setup(tokenizer, script, recover_s=5.0, limit=2):
    ids = tokenizer.encode(TEXT)
    prompt = GenerateRequest(
        "rid",
        tokenizer.encode("Count"),
        "Count",
        SamplingParams(max_tokens=len(ids), ignore_eos=True),
        stream=True,
        exclude_input_in_output=True,
    )
    decode = RestartingDecode(ids, len(prompt.prompt_ids), script)
    o = Orchestrator(
        tokenizer,
        model_args(),
        EngineConfig(max_model_len=2048),
        ScriptedPrefill(ids[0]),
        decode,
        migration_limit=limit,
        decode_recover_s=recover_s,
    )
    o.recover_poll_s = 0.01
    return o, ids, prompt, decode


def streamed(o, prompt, **kw) -> tuple[str, object]:
    deltas: list[str] = []
    final = o.run(prompt, emit=lambda r: deltas.append(r.text), **kw)
    return "".join(deltas) + final.text, final


def test_one_instance_holds_the_stream_until_decode_is_back_then_continues_it(tokenizer):
    script = [("serve", 3)] + [("refuse", NOT_READY)] * 4  # dies, then restarting
    o, ids, prompt, decode = setup(tokenizer, script)
    text, final = streamed(o, prompt)
    assert text == TEXT and final.token_ids == ids  # nothing repeated or lost
    assert final.finish_reason == "length" and final.decode_pid == 206
    assert len(decode.calls) == 6
    _, h0, p0, _, _ = decode.calls[0]
    assert h0 is not None and p0 == prompt.prompt_ids
    for _, h, p, left, _ in decode.calls[1:]:  # every try: prompt + the 4 tokens already sent
        assert h is None and p == prompt.prompt_ids + ids[:4] and left == len(ids) - 4
    gaps = [b[4] - a[4] for a, b in zip(decode.calls[1:], decode.calls[2:], strict=False)]
    assert min(gaps) >= 0.009  # refusals are retried after a poll interval, not spun on


def test_the_surviving_instance_takes_the_stream_at_once(tokenizer):
    # Triton hands the first retry to the dead instance, which fails it at once; the next
    # reaches the survivor
    o, ids, prompt, decode = setup(tokenizer, [("serve", 2), ("refuse", UNHEALTHY)])
    text, final = streamed(o, prompt)
    assert text == TEXT and final.token_ids == ids
    assert len(decode.calls) == 3
    assert decode.calls[1][4] - decode.calls[0][4] < 0.5  # the first retry did not wait


def test_a_request_decode_refuses_before_its_first_step_waits_too(tokenizer):
    # the hand-off reaches decode while it restarts: decode prefills prompt + first token
    o, ids, prompt, decode = setup(tokenizer, [("refuse", NOT_READY)] * 2)
    text, final = streamed(o, prompt)
    assert text == TEXT and len(decode.calls) == 3
    assert decode.calls[2][2] == prompt.prompt_ids + ids[:1]


def test_past_decode_recover_s_the_request_fails_with_a_clear_error(tokenizer):
    o, _, prompt, decode = setup(tokenizer, [("serve", 2)] + [("refuse", NOT_READY)] * 1000, 0.2)
    start = time.monotonic()
    with pytest.raises(PoolError, match=r"unknown model.*not back within 0.2 s"):
        streamed(o, prompt)
    assert 0.2 <= time.monotonic() - start < 2.0  # bounded, and not given up early
    assert 3 <= len(decode.calls) < 100


def test_without_a_wait_a_refusal_fails_at_once_with_decode_s_own_error(tokenizer):
    o, _, prompt, decode = setup(tokenizer, [("serve", 2), ("refuse", NOT_READY)], 0.0)
    with pytest.raises(PoolError) as err:
        streamed(o, prompt)
    assert str(err.value) == NOT_READY and len(decode.calls) == 2


def test_each_fault_gets_its_own_wait_and_the_limit_counts_faults(tokenizer):
    script = [("serve", 1), ("refuse", NOT_READY), ("serve", 1), ("refuse", NOT_READY)]
    o, ids, prompt, _ = setup(tokenizer, script, limit=2)
    assert streamed(o, prompt)[0] == TEXT  # two faults survived
    o, _, prompt, decode = setup(tokenizer, [("serve", 1)] * 3, limit=2)
    with pytest.raises(PoolError, match="died mid-request"):
        streamed(o, prompt)  # the third is one too many
    assert len(decode.calls) == 3


def test_a_client_that_leaves_while_decode_is_down_stops_the_wait(tokenizer):
    o, _, prompt, decode = setup(tokenizer, [("serve", 2)] + [("refuse", NOT_READY)] * 1000, 30)
    leave_at = time.monotonic() + 0.1
    start = time.monotonic()
    with pytest.raises(PoolError):
        streamed(o, prompt, is_cancelled=lambda: time.monotonic() > leave_at)
    assert time.monotonic() - start < 1.0


def test_a_bad_request_is_never_retried(tokenizer):
    class Refusing(RestartingDecode):
        def generate(self, request_id, params, *, handoff=None, prompt_ids=None):
            self.calls.append(request_id)
            raise RequestError("bad")
            yield

    o, ids, prompt, _ = setup(tokenizer, [])
    o.decode_pool = decode = Refusing(ids, len(prompt.prompt_ids), [])
    with pytest.raises(RequestError):
        streamed(o, prompt)
    assert len(decode.calls) == 1


def test_the_wait_is_counted_from_each_fault():
    now = [0.0]
    slept: list[float] = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    r = DecodeRecovery(3, 1.0, lambda: False, poll_s=0.4, clock=lambda: now[0], sleep=sleep)
    assert r.may_retry(True) and not slept  # a fault: at once
    assert [r.may_retry(False) for _ in range(4)] == [True, True, True, False]
    assert slept == pytest.approx([0.4, 0.4, 0.2]) and r.expired  # never past the deadline
    assert r.may_retry(True) and r.deadline is None  # served again, then a new fault
    assert r.may_retry(False) and now[0] == pytest.approx(1.4)
