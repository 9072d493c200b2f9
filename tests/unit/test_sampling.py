import pytest
import torch

from disagg.engine.sampling import sample_batch, sample_one
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
