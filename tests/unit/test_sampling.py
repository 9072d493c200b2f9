import pytest
import torch

from disagg.engine.sampling import adjust_logits, sample_batch, sample_one, token_logprobs
from disagg.engine.sequence import SamplingParams
from disagg.errors import RequestError

pytestmark = pytest.mark.unit


def logits(seed: int = 0, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    lg = logits()
    assert sample_one(lg, SamplingParams(), 0, []) == int(lg.argmax())


def test_top_k_one_and_tiny_top_p_are_greedy():
    lg = logits(1)
    for p in (
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
    ):
        assert {sample_one(lg, p, s, []) for s in range(20)} == {int(lg.argmax())}


def test_top_k_limits_the_choices():
    lg = logits(2)
    top3 = set(torch.topk(lg, 3).indices.tolist())
    p = SamplingParams(temperature=5.0, top_k=3)
    drawn = {sample_one(lg, p, s, [0] * i) for s in range(30) for i in range(3)}
    assert drawn <= top3 and len(drawn) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    lg = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = SamplingParams(temperature=1.0, top_p=0.7)  # 0.5 alone < 0.7; 0.5 + 0.3 >= 0.7
    assert {sample_one(lg, p, s, []) for s in range(200)} == {0, 1}


def test_seeded_sampling_is_reproducible_and_stateless():
    lg = logits(3)
    p = SamplingParams(temperature=1.0)
    a = [sample_one(lg, p, 42, [0] * i) for i in range(20)]
    b = [sample_one(lg, p, 42, [0] * i) for i in reversed(range(20))][::-1]  # order is free
    c = [sample_one(lg, p, 43, [0] * i) for i in range(20)]
    assert a == b and a != c


def test_batch_mixes_greedy_and_sampled_rows():
    lg = torch.stack([logits(4), logits(5)])
    params = [SamplingParams(), SamplingParams(temperature=1.0)]
    out = sample_batch(lg, params, [7, 7], [[], []])
    assert out[0] == int(lg[0].argmax())
    assert out[1] == sample_one(lg[1], params[1], 7, [])


def test_bad_words_are_never_completed():
    lg = torch.zeros(10)
    lg[3], lg[4] = 5.0, 4.0  # greedy picks 3, then 4
    single = SamplingParams(bad_words_ids=((3,),))
    assert sample_one(lg, single, 0, []) == 4
    pair = SamplingParams(bad_words_ids=((7, 3),))  # 3 is banned only right after 7
    assert sample_one(lg, pair, 0, [1, 7]) == 4
    assert sample_one(lg, pair, 0, [7, 1]) == 3
    rows = sample_batch(torch.stack([lg, lg]), [single, SamplingParams()], [0, 0], [[], []])
    assert rows == [4, 3]


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": (100,)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop"),
        ({"bad_words_ids": ((),)}, "bad_words"),
        ({"bad_words_ids": ((100,),)}, "bad_words"),
    ],
)
def test_invalid_sampling_values_are_named(kw, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kw).validate(vocab_size=100, max_tokens_limit=2048)


# ------------------------------------------------------------------ penalties and friends


def test_presence_and_frequency_penalties_count_the_output_only():
    lg = torch.tensor([0.0, 1.0, 2.0, 3.0])
    p = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5)
    out = adjust_logits(lg, p, history=[3, 3, 2], prompt=[0, 1, 1])
    # 3: twice (-2 * 0.5 - 0.25), 2: once (-0.5 - 0.25); prompt tokens 0 and 1 untouched
    assert out.tolist() == [0.0, 1.0, 1.25, 1.75]
    assert lg.tolist() == [0.0, 1.0, 2.0, 3.0]  # the caller's logits are left alone
    negative = SamplingParams(presence_penalty=-1.0)  # < 0 encourages repetition
    assert adjust_logits(lg, negative, [0, 0]).tolist() == [1.0, 1.0, 2.0, 3.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_once():
    lg = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0)
    # prompt and output both count; a token seen three times is penalised once
    out = adjust_logits(lg, p, history=[1, 1], prompt=[0, 1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    assert adjust_logits(lg, SamplingParams(repetition_penalty=0.5), [], [3])[3] == 1.0


def test_logit_bias_bans_and_forces_tokens():
    lg = torch.tensor([0.0, 5.0, 4.0, 1.0])
    assert sample_one(lg, SamplingParams(logit_bias=((1, -100.0),)), 0, []) == 2
    assert sample_one(lg, SamplingParams(logit_bias=((3, 100.0),)), 0, []) == 3
    sampled = SamplingParams(temperature=1.0, logit_bias=((1, -100.0), (2, -100.0)))
    assert 1 not in {sample_one(lg, sampled, s, []) for s in range(50)}


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    lg = torch.tensor([0.0, 1.0, 9.0, 8.0, 7.0])  # EOS (2) then the stop token 3 lead
    p = SamplingParams(min_tokens=2, stop_token_ids=(3,))
    eos = frozenset({2})
    assert sample_one(lg, p, 0, [], [5], eos) == 4
    assert sample_one(lg, p, 0, [4], [5], eos) == 4
    assert sample_one(lg, p, 0, [4, 4], [5], eos) == 2  # two tokens out: EOS may come
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)  # EOS does not end it anyway
    assert sample_one(lg, ignoring, 0, [], [], eos) == 2


def test_a_penalised_neighbour_never_changes_a_greedy_row():
    """Batch invariance: each row's adjustments touch a copy of that row alone."""
    lg = torch.stack([logits(6), logits(6), logits(6)])
    before = lg.clone()
    top = int(lg[0].argmax())
    history = [top] * 4
    neighbours = [
        SamplingParams(frequency_penalty=2.0),
        SamplingParams(repetition_penalty=5.0, logit_bias=((top, -100.0),), min_tokens=5),
        SamplingParams(temperature=1.0, presence_penalty=2.0),
    ]
    for n in neighbours:
        rows = sample_batch(
            lg,
            [SamplingParams(), n, SamplingParams()],
            [1, 1, 1],
            [history, history, history],
            [[top], [top], [top]],
            {top},
        )
        assert rows[0] == rows[2] == top  # the greedy rows: plain argmax, as alone
        assert rows[1] != top  # the neighbour moved off the repeated token
        assert torch.equal(lg, before)
    # the penalised row is what it would be alone
    alone = sample_one(lg[1], neighbours[0], 1, history, [top], {top})
    assert (
        sample_batch(
            lg[:2],
            [SamplingParams(), neighbours[0]],
            [1, 1],
            [history, history],
            [[top], [top]],
            {top},
        )[1]
        == alone
    )


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in \\[-2, 2\\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a number in \\(0, 100\\]"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logit_bias": ((100, 1.0),)}, "logit_bias must map .* token ids in \\[0, 100\\)"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "at most 300"),
        ({"min_tokens": -1}, "min_tokens must be an integer in \\[0, max_tokens=64\\]"),
        ({"min_tokens": 65}, "min_tokens"),
    ],
)
def test_bad_penalty_values_are_refused_clearly(kw, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kw).validate(vocab_size=100, max_tokens_limit=2048)


def test_logprobs_are_the_raw_distribution_not_the_sampler_adjusted_one():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(logprobs=2, temperature=0.5, presence_penalty=2.0), SamplingParams()]
    out = token_logprobs(logits, [1, 3], params)
    expected = torch.log_softmax(logits[0], -1)
    assert out[1] is None
    assert out[0].logprob == pytest.approx(float(expected[1]))
    assert [t for t, _ in out[0].top] == [0, 1]
    assert out[0].top[0][1] == pytest.approx(float(expected[0]))


def test_logprobs_limits_are_checked():
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(RequestError, match="top_logprobs"):
            SamplingParams(logprobs=bad).validate(50, 100)
    SamplingParams(logprobs=20).validate(50, 100)
