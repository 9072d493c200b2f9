"""One codec per boundary message (disagg/codec): each model's config.pbtxt template declares
exactly the tensors its codec sends and reads, every message decodes what it encodes, and
the client's fields are read with one set of defaults."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from disagg import contracts as C
from disagg.codec.fields import GenerationFields
from disagg.codec.generate import (
    ENSEMBLE_INPUTS,
    ENSEMBLE_OUTPUTS,
    OrchestratorReply,
    OrchestratorRequest,
    RouterReply,
    RouterRequest,
    TokenizeCall,
    TokenizeResponse,
    client_inputs,
)
from disagg.codec.pools import (
    DecodeCall,
    DecodeStepResponse,
    PrefillCall,
    PrefillInput,
    PrefillResponse,
)
from disagg.codec.tensors import (
    Tensors,
    encode_ack,
    encode_failure,
    raise_for_failure,
    triton_dtype,
)
from disagg.contracts import Handoff, Reply, RoutedReply
from disagg.engine.sequence import SamplingParams
from disagg.errors import KVPayloadError, PoolError, RequestError

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

# model -> (what its callers send it, what it sends back)
MODELS: dict[str, tuple[Tensors, Tensors]] = {
    "router": (RouterRequest.TENSORS, RouterReply.TENSORS),
    "orchestrator": (OrchestratorRequest.TENSORS, OrchestratorReply.TENSORS),
    "tokenizer": (TokenizeCall.TENSORS, TokenizeResponse.TENSORS),
    "prefill": (PrefillCall.TENSORS, PrefillResponse.TENSORS),
    "decode": (DecodeCall.TENSORS, DecodeStepResponse.TENSORS),
    "ensemble": (ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS),
}
_TENSOR = re.compile(
    r'\{\s*name:\s*"(?P<name>\w+)",\s*data_type:\s*(?P<type>TYPE_\w+),\s*'
    r"dims:\s*\[(?P<dims>[^\]]*)\](?P<rest>[^}]*)\}"
)


def _templates() -> dict[str, str]:
    paths = [*ROOT.glob("model_repository/*/config.pbtxt"), *ROOT.glob("ensembles/*/config.pbtxt")]
    return {p.parent.name: p.read_text() for p in paths}


def _block(text: str, which: str) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """The tensors of a config's `input [...]` or `output [...]`: name -> (type, dims,
    optional). Templates leave tensors unfilled: their placeholders are elsewhere."""
    body = re.search(rf"^{which} \[\n(.*?)^\]", text, re.M | re.S)
    assert body is not None, which
    found = {}
    for m in _TENSOR.finditer(body.group(1)):
        dims = tuple(int(d) for d in m["dims"].replace(",", " ").split())
        found[m["name"]] = (m["type"], dims, "optional: true" in m["rest"])
    return found


def _declared(tensors: Tensors, inputs: bool) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    def config_type(dtype: type) -> str:
        name = triton_dtype(dtype)
        return "TYPE_STRING" if name == "BYTES" else f"TYPE_{name}"

    return {s.name: (config_type(s.dtype), s.dims, s.optional and inputs) for s in tensors}


def test_every_model_has_a_codec():
    assert set(_templates()) == set(MODELS)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_config_template_declares_exactly_what_its_codec_sends(model):
    text = _templates()[model]
    inputs, outputs = MODELS[model]
    assert _block(text, "input") == _declared(inputs, inputs=True)
    assert _block(text, "output") == _declared(outputs, inputs=False)


def test_the_ensembles_steps_map_onto_their_models_tensors():
    text = _templates()["ensemble"]
    steps = re.findall(r'model_name: "(\w+)"(.*?)\n    \}', text, re.S)
    assert [m for m, _ in steps] == ["tokenizer", "orchestrator"]
    for model, body in steps:
        inputs, outputs = MODELS[model]
        assert set(re.findall(r'input_map \{ key: "(\w+)"', body)) <= set(inputs.names)
        assert set(re.findall(r'output_map \{ key: "(\w+)"', body)) <= set(outputs.names)


# ------------------------------------------------------------------ every message round-trips


def _check_declared(arrays: dict, tensors: Tensors, batched: bool = False) -> None:
    """Each array has its tensor's dtype, and its shape fits its dims."""
    by_name = {s.name: s for s in tensors}
    for name, arr in arrays.items():
        spec = by_name[name]
        assert arr.dtype == np.dtype(spec.dtype), name
        shape = arr.shape[1:] if batched else arr.shape
        assert len(shape) == len(spec.dims) and all(
            d in (-1, n) for d, n in zip(spec.dims, shape, strict=True)
        ), name


def test_prefill_call_and_response():
    params = SamplingParams(max_tokens=4, seed=7, stop=("x",))
    call = PrefillCall.encode([1, 2, 3], params)
    _check_declared(call, PrefillCall.TENSORS)
    assert PrefillCall.decode(call) == PrefillInput([1, 2, 3], params, skip_tokens=0)
    assert C.SKIP_TOKENS not in call  # a prefill server that predates the skip takes it
    payload = np.arange(8, dtype=np.uint8)
    answer = PrefillResponse.encode(5, 2**63, payload, 77, 1500, 2_000_000_000)
    _check_declared(answer, PrefillResponse.TENSORS)
    handoff = PrefillResponse.decode(answer)
    assert (handoff.first_token, handoff.seed, handoff.worker_pid) == (5, 2**63, 77)
    assert (handoff.prefill_time_s, handoff.start_wall_s, handoff.kv_start) == (0.0015, 2.0, 0)
    assert np.array_equal(handoff.kv_payload, payload)
    with pytest.raises(PoolError, match="lacks output 'kv_payload'"):
        PrefillResponse.decode({k: v for k, v in answer.items() if k != C.KV_PAYLOAD})


def test_sampling_controls_travel_from_the_client_to_the_pools():
    """Client tensors (TensorRT-LLM's names) -> SamplingParams -> the pools' JSON and back."""
    from disagg.pipeline.request import build_request

    sent = {
        C.INPUT_IDS: [1, 2],
        C.PRESENCE_PENALTY: 0.5,
        C.FREQUENCY_PENALTY: 1.0,
        C.REPETITION_PENALTY: 1.3,
        C.MIN_LENGTH: 4,
        C.STOP_TOKEN_IDS: [7, 8],
        C.LOGIT_BIAS: '{"9": -100, "3": 1.5}',
        C.END_ID: 6,
    }
    arrays = OrchestratorRequest.encode(sent)
    _check_declared(arrays, OrchestratorRequest.TENSORS, batched=True)
    req = build_request(OrchestratorRequest.decode(arrays), tokenizer=None, max_tokens_default=8)
    p = req.params
    assert (p.presence_penalty, p.frequency_penalty, p.min_tokens) == (0.5, 1.0, 4)
    assert p.repetition_penalty == pytest.approx(1.3)  # (FP32 on the way)
    assert p.stop_token_ids == (6, 7, 8) and p.logit_bias == ((9, -100.0), (3, 1.5))
    assert PrefillCall.decode(PrefillCall.encode([1, 2], p)).params == p
    for bad in ('["9"]', '{"nine": 1}', "{"):
        with pytest.raises(RequestError, match="logit_bias must be a JSON object"):
            GenerationFields.parse({C.LOGIT_BIAS: bad})


def test_a_prefill_call_carries_its_skip_and_the_response_where_its_payload_starts():
    params = SamplingParams(max_tokens=4)
    call = PrefillCall.encode(list(range(40)), params, skip_tokens=32)
    _check_declared(call, PrefillCall.TENSORS)
    assert PrefillCall.decode(call).skip_tokens == 32
    answer = PrefillResponse.encode(5, 1, np.zeros(8, np.uint8), 77, 1, 1, 16, kv_start=32)
    _check_declared(answer, PrefillResponse.TENSORS)
    got = PrefillResponse.decode(answer)
    assert (got.kv_start, got.num_cached_tokens) == (32, 16)
    older = {k: v for k, v in answer.items() if k != C.KV_START}  # a server before kv_start
    assert PrefillResponse.decode(older).kv_start == 0


def test_a_prefix_miss_keeps_its_kind_across_models():
    from disagg.errors import KVPrefixMissError

    sent = encode_failure(KVPrefixMissError("decode's prefix cache holds 0 of 32"))
    assert sent[C.ERROR_KIND].tolist() == [b"prefix_miss"]
    with pytest.raises(KVPrefixMissError, match="decode: decode's prefix cache holds 0"):
        raise_for_failure(sent, "decode")
    kind, message = C.split_error(C.tag_error(C.error_kind_of(KVPrefixMissError("x")), "x"))
    assert (kind, message) == (C.PREFIX_MISS, "x")  # a gRPC stream's message carries it too
    assert isinstance(C.error_from_kind(kind, message, "decode at h:1"), KVPrefixMissError)


def test_decode_call_carries_a_handoff_or_the_prompt():
    params = SamplingParams(max_tokens=3)
    handoff = Handoff(11, 5, np.arange(4, dtype=np.uint8), worker_pid=1, prefill_time_s=0.0)
    call = DecodeCall.encode(params, handoff=handoff)
    _check_declared(call, DecodeCall.TENSORS)
    got = DecodeCall.decode(call)
    assert (got.params, got.prompt_ids, got.first_token, got.seed) == (params, None, 11, 5)
    assert got.kv_payload is not None and got.kv_payload.tolist() == [0, 1, 2, 3]
    assert DecodeCall.decode(DecodeCall.encode(params, prompt_ids=[4, 5])).prompt_ids == [4, 5]
    with pytest.raises(RequestError, match="give kv_payload"):
        DecodeCall.decode({C.SAMPLING: call[C.SAMPLING]})
    with pytest.raises(KVPayloadError, match="needs first_token"):
        DecodeCall.decode({C.KV_PAYLOAD: call[C.KV_PAYLOAD]})


def test_decode_steps_with_and_without_load():
    step = DecodeStepResponse.encode([5, 6], "length", 55, load=(3, 1, 5, 800))
    _check_declared(step, DecodeStepResponse.TENSORS)
    decoded = DecodeStepResponse.decode(step)
    assert (decoded.token_ids, decoded.finish_reason, decoded.worker_pid) == ([5, 6], "length", 55)
    assert DecodeStepResponse.load(step) == (3, 1, 5, 800)
    plain = DecodeStepResponse.encode([], None, 55)
    assert DecodeStepResponse.load(plain) is None
    assert DecodeStepResponse.decode(plain).finish_reason is None
    assert C.DECODE_LOAD not in DecodeStepResponse.requested(with_load=False)
    assert C.DECODE_LOAD in DecodeStepResponse.requested(with_load=True)


def test_the_orchestrators_reply_as_the_router_reads_it():
    final = Reply("Paris", 5, 1, finish_reason="stop", served_by=C.DISAGGREGATED, kv_bytes=9)
    arrays = OrchestratorReply.encode(final, batched=True)
    _check_declared(arrays, OrchestratorReply.TENSORS, batched=True)
    assert OrchestratorReply.decode(arrays) == RoutedReply(
        "Paris", 5, 1, "stop", served_by=C.DISAGGREGATED
    )
    delta = OrchestratorReply.encode(Reply("Par", 5, 1), batched=True)
    assert set(delta) == set(ENSEMBLE_OUTPUTS.names)  # where it was served: final only
    assert OrchestratorReply.decode(encode_ack(9, batched=True)) is None


def test_the_routers_reply_as_a_client_reads_it():
    final = RoutedReply("hi", 3, 1, "stop", target="lpu", reason="interactive", served_by="g")
    arrays = RouterReply.encode(final, batched=True)
    _check_declared(arrays, RouterReply.TENSORS, batched=True)
    assert RouterReply.decode(arrays) == final
    assert RouterReply.extras(arrays)[C.ROUTE_TARGET] == "lpu"
    delta = RouterReply.encode(RoutedReply("h", 3, 1), batched=True)
    assert RouterReply.extras(delta) == {} and RouterReply.decode(delta).finish_reason is None


def test_requests_keep_the_clients_fields():
    fields = {
        C.INPUT_IDS: [1, 2],
        C.TEXT_INPUT: "hé",
        C.MAX_TOKENS: 4,
        C.SEED: 2**63 - 1,
        C.STOP_WORDS: ["a", "b"],
        C.TEMPERATURE: 0.5,
        C.STREAM: True,
    }
    arrays = OrchestratorRequest.encode(fields)
    _check_declared(arrays, OrchestratorRequest.TENSORS, batched=True)
    assert arrays[C.SEED].dtype == np.uint64 and arrays[C.INPUT_IDS].shape == (1, 2)
    assert OrchestratorRequest.decode(arrays) == fields
    hints = {C.TEXT_INPUT: "x", C.LATENCY_SLA_MS: 150.0, C.PRIORITY: 2, C.MESSAGES: "[]"}
    assert RouterRequest.decode(RouterRequest.encode(hints)) == hints
    with pytest.raises(KeyError):
        OrchestratorRequest.encode({C.LATENCY_SLA_MS: 1.0})  # not the orchestrator's
    text, messages, chat = TokenizeCall.decode(RouterRequest.encode(hints))
    assert (text, messages, chat) == ("x", "[]", False)


def test_a_client_sends_each_input_with_its_declared_dtype():
    arrays = client_inputs({C.TEMPERATURE: 1, C.LATENCY_SLA_MS: 150, C.INPUT_IDS: [3], "x": 2})
    assert arrays[C.TEMPERATURE].dtype == np.float32  # an int from JSON is still FP32
    assert arrays[C.LATENCY_SLA_MS].dtype == np.float32
    assert arrays[C.INPUT_IDS].dtype == np.int32
    assert arrays["x"].dtype == np.int32  # no model's: as its Python type, for Triton to refuse


def test_the_client_fields_have_one_set_of_defaults():
    g = GenerationFields.parse({})
    assert (g.max_tokens, g.temperature, g.top_k, g.top_p, g.seed) == (None, 0.0, 0, 1.0, None)
    assert not g.exclude_input_in_output and not g.stream and not g.ignore_eos
    g = GenerationFields.parse({C.STOP_WORDS: ["", "END"], C.BAD_WORDS: [""], C.END_ID: 2})
    assert (g.stop_words, g.bad_words, g.end_id) == (("END",), (), 2)


@pytest.mark.parametrize(
    "exc, raised",
    [(RequestError("too long"), RequestError), (RuntimeError("broke"), PoolError)],
)
def test_a_failure_sent_as_outputs_is_raised_with_its_kind(exc, raised):
    arrays = encode_failure(exc)
    assert arrays[C.ERROR_KIND][0] == C.error_kind_of(exc).encode()
    with pytest.raises(raised, match=str(exc)):
        raise_for_failure(arrays, "decode")
    raise_for_failure({C.ERROR_KIND: np.array([b""], np.object_)}, "decode")  # no failure


def test_logprobs_travel_with_their_tokens_through_every_message():
    from disagg.engine.sequence import TokenLogprob

    lps = [TokenLogprob(-0.5, ((7, -0.5), (9, -1.25))), TokenLogprob(-2.0, ())]
    step = DecodeStepResponse.decode(DecodeStepResponse.encode([7, 3], None, 11, logprobs=lps))
    assert step.logprobs == lps and step.token_ids == [7, 3]
    assert DecodeStepResponse.decode(DecodeStepResponse.encode([7], None, 11)).logprobs is None
    arrays = PrefillResponse.encode(7, 1, np.zeros(4, np.uint8), 2, 3, 4, first_logprob=lps[0])
    assert PrefillResponse.decode(arrays).first_logprob == lps[0]
    bad = DecodeStepResponse.encode([7, 3], None, 11, logprobs=lps[:1])  # one for two tokens
    with pytest.raises(RequestError, match="token_logprobs"):
        DecodeStepResponse.decode(bad)
    content = [{"token": "Par", "logprob": -0.5, "bytes": [80, 97, 114], "top_logprobs": []}]
    reply = OrchestratorReply.encode(Reply("Par", 5, 1, logprobs=content), batched=True)
    assert reply[C.OUTPUT_LOG_PROBS].shape == (1, 1, 1)  # TensorRT-LLM's [batch, beam, token]
    routed = OrchestratorReply.decode(reply)
    assert routed is not None and routed.logprobs == content
    out = RouterReply.decode(RouterReply.encode(routed, batched=True))
    assert out.logprobs == content
    plain = OrchestratorReply.encode(Reply("Par", 5, 1), batched=True)
    assert plain[C.OUTPUT_LOG_PROBS].size == 0 and C.OUTPUT_LOGPROBS_CONTENT not in plain
