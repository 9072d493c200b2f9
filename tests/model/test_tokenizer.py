"""Tokenizer built from the GGUF metadata, chat template, and streaming detokenization."""

import pytest

from disagg.engine.tokenizer import REPLACEMENT_CHAR, TextStream
from disagg.errors import RequestError

pytestmark = pytest.mark.model

TEXTS = [
    "Hello world, it's 2026 and 12345 apples cost $3.50!",
    "  leading spaces and\ttabs\nnew lines  ",
    "中文测试：分离式推理架构把预填充和解码拆开。",
    "emoji 🚀🔥 family 👨‍👩‍👧 flags 🇫🇷 done",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids and tokenizer.decode(ids) == text


def test_digits_are_split_one_by_one(tokenizer):
    # SmolLM2's pre-tokenizer ("smollm" in GGUF) splits numbers into single digits
    ids = tokenizer.encode("12345")
    assert [tokenizer.decode([i]) for i in ids] == list("12345")


def test_matches_transformers_gguf_tokenizer(tokenizer):
    from transformers import AutoTokenizer

    from disagg.engine.checkpoint import find_packaged_smollm2

    g = find_packaged_smollm2()
    ref = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    for text in TEXTS[:3] + ["<|im_start|>user\nhi<|im_end|>"]:
        assert tokenizer.encode(text) == ref(text, add_special_tokens=False)["input_ids"]


def test_chat_template_and_special_tokens(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in text  # default system prompt
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids.count(tokenizer.eos_token_id) == 2  # <|im_end|> closes system and user turns
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "messages, msg",
    [
        ([], "non-empty"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user", "content": 5}], "content"),
        ("hello", "non-empty list"),
    ],
)
def test_bad_messages_are_refused(tokenizer, messages, msg):
    with pytest.raises(RequestError, match=msg):
        tokenizer.encode_chat(messages)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_deltas_concatenate_to_the_text_without_broken_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer)
    deltas = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_stop_string_ends_the_stream_and_is_not_returned(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story, more text")
    stream = TextStream(tokenizer, stop=("END",))
    out = ""
    for i in ids:
        out += stream.push(i)
        if stream.stopped:
            break
    assert stream.stopped and out == "The answer is 42. "


def test_text_that_only_looks_like_a_stop_prefix_is_released(tokenizer):
    ids = tokenizer.encode("we ENjoy it")
    stream = TextStream(tokenizer, stop=("END",))
    out = "".join(stream.push(i) for i in ids)
    assert not stream.stopped
    assert out + stream.flush() == "we ENjoy it"
    assert len(out) >= len("we ENjoy it") - 2  # at most len("END") - 1 characters held back


def test_eos_ids_read_from_the_files_are_the_tokenizers(engine_dir, tokenizer):
    """The pools read EOS ids from the engine's files (engine/tokenizer.py eos_token_ids,
    0.09 s instead of building the tokenizer): the same ids the tokenizer gives."""
    from disagg.engine.tokenizer import eos_token_ids

    assert eos_token_ids(engine_dir) == {tokenizer.eos_token_id}
