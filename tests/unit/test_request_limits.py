"""What the gateway and the entry models refuse of a request before serving it: a request head
over the limits, parameters that are no input, and client text repeated into a log."""

import pytest

from disagg import contracts as C
from disagg.codec.generate import RouterRequest
from disagg.codec.tensors import check_parameters
from disagg.errors import RequestError
from disagg.gateway.http import (
    LOG_TEXT_CHARS,
    MAX_HEAD_BYTES,
    MAX_HEADER_LINE_BYTES,
    head_excess,
    loggable,
)

pytestmark = pytest.mark.unit


def test_a_usual_head_passes_and_one_big_header_or_many_small_ones_do_not():
    usual = [(b"host", b"x"), (b"authorization", b"Bearer sk-" + b"a" * 64)]
    assert head_excess("POST", b"/v1/chat/completions?", usual) is None
    big = head_excess("GET", b"/", [(b"x-big", b"a" * 100_000)])
    assert big is not None and str(MAX_HEADER_LINE_BYTES) in big
    # each line under the per-line limit, together over the whole head's
    many = [(f"x-h{i}".encode(), b"a" * 4000) for i in range(5)]
    assert all(len(n) + len(v) + 4 <= MAX_HEADER_LINE_BYTES for n, v in many)
    whole = head_excess("GET", b"/", many)
    assert whole is not None and str(MAX_HEAD_BYTES) in whole
    # a long URL counts toward the head
    assert head_excess("GET", b"/" + b"a" * MAX_HEAD_BYTES, usual) is not None


def test_a_logged_value_is_bounded_and_on_one_line():
    huge = loggable("x" * 1_000_000)
    assert len(huge) < LOG_TEXT_CHARS + 50 and huge.endswith("(999800 more characters)")
    forged = loggable("no model 'a'\n2025-01-01 disagg.gateway: request forged\r\x1b[31m\x00")
    assert "\n" not in forged and "\r" not in forged and "\x1b" not in forged
    assert "\\n2025-01-01" in forged and "\\x1b[31m" in forged and "\\x00" in forged
    assert all(c.isprintable() for c in loggable("\u2028\x85\t"))
    assert loggable("'temperature' must be a number") == "'temperature' must be a number"


def test_parameters_that_are_no_input_are_refused_by_name():
    check_parameters({}, RouterRequest.TENSORS, "router")
    check_parameters(
        {C.CALLER_PARAM: C.BLS_CALLER, C.TOKEN_PARAM: "t", C.CALLER_PID_PARAM: 1},
        RouterRequest.TENSORS,
        "router",
    )
    with pytest.raises(RequestError, match=r"unknown input 'max_token' for model 'router'") as e:
        check_parameters({"max_token": 8}, RouterRequest.TENSORS, "router")
    assert C.MAX_TOKENS in str(e.value)  # says what the model does take
    many = {f"k{i}\n{'z' * 1000}": 1 for i in range(50)}
    with pytest.raises(RequestError) as e:
        check_parameters(many, RouterRequest.TENSORS, "router")
    assert len(str(e.value)) < 2000 and "\n" not in str(e.value)
