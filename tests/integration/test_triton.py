"""The prefill/decode pipeline served by a real tritonserver, used by real clients."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.triton_server import admin_post, eventually, metric, once_more_if_upstream_aborted

from disagg import contracts as C
from disagg.client import GenerateError, GrpcClient, HttpClient
from disagg.engine.sequence import SamplingParams
from disagg.engine.tokenizer import REPLACEMENT_CHAR

pytestmark = pytest.mark.integration

PROMPTS = [
    "What is the capital of France?",
    "Write two sentences about the ocean.",
    "用中文写一句关于月亮的话，并加一个表情符号。",
    "Reply with three emoji that describe a party.",
]


@pytest.fixture(scope="module")
def http(server):
    return HttpClient(server.endpoints.http, timeout_s=120)


@pytest.fixture(scope="module")
def grpc(server):
    client = GrpcClient(server.endpoints.grpc, timeout_s=120)
    yield client
    client.close()


def chat(prompt: str, max_tokens: int = 48, **kw) -> dict:
    return {
        C.TEXT_INPUT: prompt,
        C.APPLY_CHAT_TEMPLATE: True,
        C.MAX_TOKENS: max_tokens,
        C.EXCLUDE_INPUT_IN_OUTPUT: True,
        **kw,
    }


def expected(llm, prompt: str, max_tokens: int = 48):
    """What the engine in this process answers: the reference for the served pipeline."""
    (c,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens))
    return c


def test_generate_equals_the_engine_token_for_token(http, llm):
    for prompt in PROMPTS[:2]:
        ref = expected(llm, prompt)
        r = http.generate("ensemble", chat(prompt))
        assert r.text == ref.text
        assert r.num_output_tokens == len(ref.token_ids)
        assert r.finish_reason == ref.finish_reason.value
        assert r.num_input_tokens == len(ref.prompt_token_ids)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_deltas_concatenate_to_the_full_reply(http, prompt):
    full = http.generate("ensemble", chat(prompt))
    streamed = http.generate("ensemble", chat(prompt), stream=True)
    assert len(streamed.deltas) > 1
    assert "".join(streamed.deltas) == full.text == streamed.text
    assert not any(REPLACEMENT_CHAR in d for d in streamed.deltas)


def test_trtllm_style_request_echoes_the_prompt_and_accepts_empty_word_lists(http):
    r = http.generate(
        "ensemble",
        {
            C.TEXT_INPUT: "The capital of France is",
            C.MAX_TOKENS: 8,
            C.BAD_WORDS: [""],
            C.STOP_WORDS: [""],
        },
    )
    assert r.text.startswith("The capital of France is") and len(r.text) > 24


def test_http_infer_with_tritonclient(server, http):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.endpoints.http.removeprefix("http://"))
    inputs = []
    for name, arr, dtype in [
        (C.TEXT_INPUT, np.array([[PROMPTS[0].encode()]], dtype=np.object_), "BYTES"),
        (C.MAX_TOKENS, np.array([[24]], dtype=np.int32), "INT32"),
        (C.APPLY_CHAT_TEMPLATE, np.array([[True]]), "BOOL"),
        (C.EXCLUDE_INPUT_IN_OUTPUT, np.array([[True]]), "BOOL"),
    ]:
        t = httpclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    out = client.infer("ensemble_sync", inputs)
    text = out.as_numpy(C.TEXT_OUTPUT).reshape(-1)[0].decode()
    assert text == http.generate("ensemble", chat(PROMPTS[0], 24)).text
    assert out.as_numpy(C.NUM_OUTPUT_TOKENS).reshape(-1)[0] > 0


def test_grpc_streaming(grpc, http):
    r = grpc.generate("ensemble", chat(PROMPTS[2]))
    assert len(r.deltas) > 1 and r.finish_reason in ("stop", "length")
    assert r.text == http.generate("ensemble", chat(PROMPTS[2])).text


def _is_stub_of(pid: int, model: str) -> bool:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return b"triton_python_backend_stub" in args[0] and f"/{model}/".encode() in args[1]


def test_prefill_and_decode_run_in_different_processes(http, server):
    r = http.generate("orchestrator", {C.INPUT_IDS: [1, 2, 3, 4], C.MAX_TOKENS: 4})
    out = r.extra
    assert out[C.SERVED_BY] == "disaggregated"
    prefill_pid, decode_pid = out[C.PREFILL_PID], out[C.DECODE_PID]
    assert len({prefill_pid, decode_pid, os.getpid(), server.proc.pid}) == 4
    assert _is_stub_of(prefill_pid, "prefill") and _is_stub_of(decode_pid, "decode")


def test_eight_concurrent_streams_complete_correctly(http, llm):
    jobs = [(PROMPTS[i % 4], 16 + 12 * i) for i in range(8)]
    refs = [expected(llm, p, n) for p, n in jobs]
    results: dict[int, object] = {}

    def run(i):
        p, n = jobs[i]
        try:
            results[i] = http.generate("ensemble", chat(p, n), stream=True)
        except Exception as e:  # surfaced by the assertion below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, ref in enumerate(refs):
        assert not isinstance(results[i], Exception), results[i]
        assert results[i].text == ref.text, f"stream {i}"


def test_cancelled_stream_frees_its_decode_slot(server, grpc, http):
    seen_active = []
    deltas = []

    def on_delta(d):
        deltas.append(d)
        if len(deltas) == 3:  # the first delta comes from prefill, before decode has it
            seen_active.append(metric(server, "disagg_decode_active_sequences"))

    r = grpc.generate(
        "ensemble",
        chat("Count from 1 to 500, one number per line.", 400),
        on_delta=on_delta,
        cancel_after_deltas=5,
    )
    assert r.finish_reason == "cancelled" and seen_active == [1.0]
    deadline = time.monotonic() + 15
    while metric(server, "disagg_decode_active_sequences") != 0.0:
        assert time.monotonic() < deadline, "decode slot not freed after cancel"
        time.sleep(0.2)
    assert http.generate("ensemble", chat("Hi", 4)).num_output_tokens > 0


@pytest.mark.parametrize(
    "body, message",
    [
        ({C.TEXT_INPUT: "", C.MAX_TOKENS: 5}, "prompt is empty"),
        (chat("Hi", 0), "max_tokens must be in [1, 512]"),
        (chat("Hi", 5000), "max_tokens must be in [1, 512]"),
        (chat("word " * 2100, 8), "context limit"),
        (chat("Hi", 8, top_p=5.0), "top_p"),
        (chat("Hi", 8, top_k=-3), "top_k"),
        (chat("Hi", 8, temperature=-1.0), "temperature"),
        (chat("Hi", 3_000_000_000), "above 2147483647"),  # Triton wraps it into INT32
        (chat("Hi", 4, end_id=1_000_000), "end_id"),
        ({C.TEXT_INPUT: "", C.MESSAGES: '[{"role": "robot"}]', C.MAX_TOKENS: 4}, "role"),
        ({C.TEXT_INPUT: "", C.MESSAGES: "not json", C.MAX_TOKENS: 4}, "not valid JSON"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_next_request_succeeds(http, body, message):
    with pytest.raises(GenerateError) as err:
        http.generate("ensemble", body)
    assert err.value.status == 400 and message in str(err.value)
    assert http.generate("ensemble", chat("Hi", 4)).num_output_tokens > 0


def test_chat_messages_alone_are_a_prompt(http):
    messages = json.dumps([{"role": "user", "content": PROMPTS[0]}])
    by_messages = http.generate("ensemble", {C.MESSAGES: messages, C.MAX_TOKENS: 48})
    assert by_messages.text == http.generate("ensemble", chat(PROMPTS[0])).text


def test_a_request_with_no_prompt_at_all_is_refused(http):
    with pytest.raises(GenerateError) as err:
        http.generate("ensemble", {C.MAX_TOKENS: 8})
    assert err.value.status == 400 and "0 inputs" in str(err.value)
    assert http.generate("ensemble", chat("Hi", 4)).num_output_tokens > 0


def test_wrong_json_type_is_refused_by_triton(http):
    """Triton's generate endpoint parses the JSON before any model sees it; it answers a
    string where an INT32 belongs with HTTP 500 (its choice, not ours) and a clear message."""
    with pytest.raises(GenerateError, match="Unable to parse 'data'") as err:
        http.generate("ensemble", {C.TEXT_INPUT: "Hi", C.MAX_TOKENS: "lots"})
    assert err.value.status in (400, 500)
    assert http.generate("ensemble", chat("Hi", 4)).num_output_tokens > 0


def test_wrong_dtype_over_grpc_is_refused(grpc):
    import tritonclient.grpc as grpcclient

    arr = np.array([[8.0]], dtype=np.float32)
    t = grpcclient.InferInput(C.MAX_TOKENS, [1, 1], "FP32")
    t.set_data_from_numpy(arr)
    text = grpcclient.InferInput(C.TEXT_INPUT, [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"Hi"]], dtype=np.object_))
    with pytest.raises(Exception, match="data-type is 'FP32'"):
        grpc.client.infer("ensemble_sync", [text, t])


def _repository(server, model: str, action: str, key: str | None) -> int:
    return admin_post(server, f"/v2/repository/models/{model}/{action}", key)


def test_prefill_pool_down_falls_back_to_decode_prefill(server, http, llm):
    assert _repository(server, "prefill", "unload", key=None) == 403  # admin API needs the key
    assert _repository(server, "prefill", "unload", key="test-admin-key") == 200
    try:
        r = http.generate("orchestrator", {C.INPUT_IDS: llm.encode(PROMPTS[0]), C.MAX_TOKENS: 48})
        assert r.extra[C.SERVED_BY] == "fallback"
        assert r.text == expected(llm, PROMPTS[0]).text
    finally:
        assert _repository(server, "prefill", "load", key="test-admin-key") == 200
    r = http.generate("orchestrator", {C.INPUT_IDS: [1, 2, 3], C.MAX_TOKENS: 2})
    assert r.extra[C.SERVED_BY] == "disaggregated"


def test_decode_process_killed_mid_stream_is_held_then_continued(server, http):
    """One decode instance: the orchestrator holds the stream while the supervisor restarts
    decode, then the new one continues it (pipeline/recovery.py): one stream, the text of an
    undisturbed run (greedy, ignore_eos)."""
    # ignore_eos: still decoding when the kill lands, however fast decode is
    body = {**chat("Write a long story about a dragon.", 96), C.IGNORE_EOS: True}
    undisturbed = http.generate("ensemble", body)
    killed: list[float] = []
    deltas: list[str] = []

    def killed_run():
        pid = http.generate("orchestrator", {C.INPUT_IDS: [1, 2, 3], C.MAX_TOKENS: 2}).extra[
            C.DECODE_PID
        ]
        killed.clear()
        deltas.clear()

        def kill_on_third(_):
            if len(killed) == 0 and len(deltas) == 2:
                os.kill(pid, signal.SIGKILL)
                killed.append(time.monotonic())
            deltas.append(_)

        try:
            return pid, http.generate("ensemble", body, stream=True, on_delta=kill_on_third)
        except GenerateError as e:  # the server itself died: see once_more_if_upstream_aborted
            return pid, e

    pid, r = once_more_if_upstream_aborted(server, killed_run)
    assert not isinstance(r, GenerateError), r
    assert killed and r.text == "".join(deltas) == undisturbed.text
    assert r.num_output_tokens == 96 and r.finish_reason == "length"

    # the supervisor counts a restart at its next check after the reload (about a second)
    def restart_counted():
        assert server.supervisor.num_restarts >= 1

    eventually(restart_counted)
    new_pid = http.generate("orchestrator", {C.INPUT_IDS: [1, 2], C.MAX_TOKENS: 2}).extra[
        C.DECODE_PID
    ]
    assert new_pid != pid


def test_doctor_on_a_running_server_finds_every_model_ready_and_times_a_request(server):
    from disagg.doctor import checks, run_checks

    results = {r.name: r for r in run_checks(server.settings)}
    assert results["models ready"].status == checks.OK, results["models ready"]
    assert results["warm-up TTFT"].status in (checks.OK, checks.WARN), results["warm-up TTFT"]
    assert "to the first token" in results["warm-up TTFT"].detail
    assert results["ports"].status == checks.OK and "running Triton" in results["ports"].detail
