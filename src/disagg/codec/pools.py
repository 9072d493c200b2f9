"""The orchestrator's calls of its pools, declared once for both callers (over BLS in one
server: triton/pools.py; over gRPC across servers: remote/pools.py) and for the pool models
that answer them (triton/prefill_side.py, triton/decode_side.py):

    PrefillCall -> prefill -> PrefillResponse (a Handoff: first token + KV payload bytes,
                                               from the prompt position decode lacks)
    DecodeCall (a Handoff, or prompt ids) -> decode -> DecodeStepResponse, one per step

The pools have no batch dimension (max_batch_size 0). Sampling parameters travel as one
JSON string, the KV cache as the bytes of a KVPayload (or a kvnet reference to pull).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from disagg import contracts as C
from disagg.codec.tensors import FAILURE, Array, Arrays, Tensors, TensorSpec, required
from disagg.contracts import DecodeStep, Handoff
from disagg.engine.sequence import SamplingParams, TokenLogprob
from disagg.errors import KVPayloadError, RequestError

_SAMPLING = TensorSpec(C.SAMPLING, np.object_)  # BYTES [1]: JSON of SamplingParams
_FIRST_TOKEN = TensorSpec(C.FIRST_TOKEN, np.int32)
_RESOLVED_SEED = TensorSpec(C.RESOLVED_SEED, np.uint64)
_KV_PAYLOAD = TensorSpec(C.KV_PAYLOAD, np.uint8, (-1,))  # KVPayload.to_bytes(), or a KVRef
_WORKER_PID = TensorSpec(C.WORKER_PID, np.int32)  # the process that answered
_NUM_CACHED = TensorSpec(C.NUM_CACHED_TOKENS, np.int32)  # prompt tokens from a prefix cache


_LOGPROBS = TensorSpec(C.TOKEN_LOGPROBS, np.object_)  # JSON: one TokenLogprob per token


def _first_int(arrays: Mapping[str, Array], name: str) -> int:
    return int(required(arrays, name)[0])


def _logprobs_json(logprobs: list[TokenLogprob]) -> str:
    return json.dumps([lp.to_json() for lp in logprobs])


def _first_logprob(arrays: Mapping[str, Array]) -> TokenLogprob | None:
    logprobs = _read_logprobs(arrays, 1)
    return logprobs[0] if logprobs else None


def _read_logprobs(arrays: Mapping[str, Array], num_tokens: int) -> list[TokenLogprob] | None:
    """TOKEN_LOGPROBS, when sent: one per token (RequestError when it is not)."""
    value = arrays.get(C.TOKEN_LOGPROBS)
    if value is None:
        return None
    try:
        items = json.loads(value.reshape(-1)[0])
        logprobs = [TokenLogprob.from_json(x) for x in items]
    except (ValueError, TypeError) as e:
        raise RequestError(f"malformed {C.TOKEN_LOGPROBS}: {e}") from e
    if len(logprobs) != num_tokens:
        raise RequestError(f"{C.TOKEN_LOGPROBS}: {len(logprobs)} for {num_tokens} tokens")
    return logprobs


# ------------------------------------------------------------------ prefill


@dataclass(frozen=True)
class PrefillInput:
    """What the prefill model is asked."""

    prompt_ids: list[int]
    params: SamplingParams
    # leading prompt tokens (whole blocks) the payload leaves out: decode holds their K/V
    skip_tokens: int = 0


class PrefillCall:
    """orchestrator -> prefill: the prompt, how to sample its first token, and how much of
    its K/V the payload may leave out."""

    TENSORS = Tensors(
        (
            TensorSpec(C.PROMPT_IDS, np.int32, (-1,)),
            _SAMPLING,
            TensorSpec(C.SKIP_TOKENS, np.int32, optional=True),  # absent: 0
        )
    )

    @staticmethod
    def encode(prompt_ids: list[int], params: SamplingParams, skip_tokens: int = 0) -> Arrays:
        values: dict[str, object] = {
            C.PROMPT_IDS: prompt_ids,
            C.SAMPLING: C.sampling_to_json(params),
        }
        if skip_tokens:
            values[C.SKIP_TOKENS] = skip_tokens
        return PrefillCall.TENSORS.encode(values)

    @staticmethod
    def decode(arrays: Mapping[str, Array]) -> PrefillInput:
        f = PrefillCall.TENSORS.read(arrays, batched=False)
        params = C.sampling_from_json(f.get(C.SAMPLING, "{}"))
        return PrefillInput(f.get(C.PROMPT_IDS, []), params, f.get(C.SKIP_TOKENS, 0))


class PrefillResponse:
    """prefill -> orchestrator: a Handoff, the KV payload still as bytes."""

    TENSORS = Tensors(
        (
            _FIRST_TOKEN,
            _RESOLVED_SEED,
            _KV_PAYLOAD,
            _WORKER_PID,
            TensorSpec(C.PREFILL_TIME_US, np.int64),  # compute only
            TensorSpec(C.PREFILL_START_NS, np.int64),  # wall clock when compute began
            _NUM_CACHED,
            TensorSpec(C.KV_START, np.int32),  # the payload's first prompt position
            _LOGPROBS,  # the first token's, when asked for
        )
    )

    @staticmethod
    def encode(
        first_token: int,
        seed: int,
        kv_payload: Array,
        pid: int,
        compute_us: int,
        start_ns: int,
        num_cached_tokens: int = 0,
        kv_start: int = 0,
        first_logprob: TokenLogprob | None = None,
    ) -> Arrays:
        values: dict[str, object] = {
            C.FIRST_TOKEN: first_token,
            C.RESOLVED_SEED: seed,
            C.KV_PAYLOAD: kv_payload,
            C.WORKER_PID: pid,
            C.PREFILL_TIME_US: compute_us,
            C.PREFILL_START_NS: start_ns,
            C.NUM_CACHED_TOKENS: num_cached_tokens,
            C.KV_START: kv_start,
        }
        if first_logprob is not None:
            values[C.TOKEN_LOGPROBS] = _logprobs_json([first_logprob])
        return PrefillResponse.TENSORS.encode(values)

    @staticmethod
    def decode(arrays: Mapping[str, Array]) -> Handoff:
        return Handoff(
            first_token=_first_int(arrays, C.FIRST_TOKEN),
            seed=_first_int(arrays, C.RESOLVED_SEED),
            kv_payload=required(arrays, C.KV_PAYLOAD),
            worker_pid=_first_int(arrays, C.WORKER_PID),
            prefill_time_s=_first_int(arrays, C.PREFILL_TIME_US) / 1e6,
            start_wall_s=_first_int(arrays, C.PREFILL_START_NS) / 1e9,
            num_cached_tokens=_first_int(arrays, C.NUM_CACHED_TOKENS),
            # absent from an older prefill server: it sent the whole prompt
            kv_start=int(arrays[C.KV_START].reshape(-1)[0]) if C.KV_START in arrays else 0,
            first_logprob=_first_logprob(arrays),
        )


# ------------------------------------------------------------------ decode


@dataclass(frozen=True)
class DecodeInput:
    """What the decode model is asked: go on from a prefill's hand-off, or prefill the prompt
    itself (the co-located mode, and the fallback when the prefill pool failed)."""

    params: SamplingParams
    # the prompt: decode prefills it when there is no hand-off; with one, it names the
    # handed-off K/V for decode's prefix cache (None: not sent)
    prompt_ids: list[int] | None
    first_token: int = 0
    seed: int = 0
    kv_payload: Array | None = None  # uint8 [n]: the payload's bytes, or a KVRef to pull


class DecodeCall:
    """orchestrator -> decode: the sampling parameters, and a Handoff or the prompt ids."""

    TENSORS = Tensors(
        (
            _SAMPLING,
            TensorSpec(C.PROMPT_IDS, np.int32, (-1,), optional=True),
            TensorSpec(C.FIRST_TOKEN, np.int32, optional=True),
            TensorSpec(C.RESOLVED_SEED, np.uint64, optional=True),
            TensorSpec(C.KV_PAYLOAD, np.uint8, (-1,), optional=True),
        )
    )
    _VALUES = TENSORS.without(Tensors((_KV_PAYLOAD,)))  # read as values; the payload is not

    @staticmethod
    def encode(
        params: SamplingParams,
        handoff: Handoff | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Arrays:
        values: dict[str, object] = {C.SAMPLING: C.sampling_to_json(params)}
        if handoff is not None:
            values |= {
                C.FIRST_TOKEN: handoff.first_token,
                C.RESOLVED_SEED: handoff.seed,
                C.KV_PAYLOAD: handoff.kv_payload,
            }
        if prompt_ids is not None or handoff is None:
            values[C.PROMPT_IDS] = prompt_ids or []
        return DecodeCall.TENSORS.encode(values)

    @staticmethod
    def decode(arrays: Mapping[str, Array]) -> DecodeInput:
        f = DecodeCall._VALUES.read(arrays, batched=False)
        params = C.sampling_from_json(f.get(C.SAMPLING, "{}"))
        payload = arrays.get(C.KV_PAYLOAD)
        if payload is None:
            if C.PROMPT_IDS not in f:
                raise RequestError(f"give {C.KV_PAYLOAD} (with {C.FIRST_TOKEN}) or {C.PROMPT_IDS}")
            return DecodeInput(params, f[C.PROMPT_IDS])
        if C.FIRST_TOKEN not in f or C.RESOLVED_SEED not in f:
            raise KVPayloadError(f"{C.KV_PAYLOAD} needs {C.FIRST_TOKEN} and {C.RESOLVED_SEED}")
        return DecodeInput(
            params, f.get(C.PROMPT_IDS), f[C.FIRST_TOKEN], f[C.RESOLVED_SEED], payload.reshape(-1)
        )


class DecodeStepResponse:
    """decode -> orchestrator, once per step: the new tokens (none in the first response, the
    acknowledgement), the finish reason on the last, and, to a caller that asks, the decode
    engine's load; a failure after the first response as outputs."""

    _LOAD = TensorSpec(C.DECODE_LOAD, np.int32, (4,))  # running, waiting, free slots, free KV
    TENSORS = (
        Tensors(
            (
                TensorSpec(C.TOKEN_IDS, np.int32, (-1,)),
                TensorSpec(C.FINISH_REASON, np.object_),
                _WORKER_PID,
                _NUM_CACHED,
                _LOAD,
                _LOGPROBS,  # when the request asks for them
            )
        )
        + FAILURE
    )

    @staticmethod
    def requested(with_load: bool) -> list[str]:
        """What a caller asks for; the load costs decode a look at its engine, so only a
        caller choosing among replicas asks for it."""
        names = DecodeStepResponse.TENSORS.names
        return [n for n in names if with_load or n != C.DECODE_LOAD]

    @staticmethod
    def encode(
        token_ids: list[int],
        finish_reason: str | None,
        pid: int,
        load: tuple[int, ...] | None = None,
        num_cached_tokens: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> Arrays:
        values: dict[str, object] = {
            C.TOKEN_IDS: token_ids,
            C.FINISH_REASON: finish_reason or "",
            C.WORKER_PID: pid,
            C.NUM_CACHED_TOKENS: num_cached_tokens,
        }
        if load is not None:
            values[C.DECODE_LOAD] = list(load)
        if logprobs:
            values[C.TOKEN_LOGPROBS] = _logprobs_json(logprobs)
        return DecodeStepResponse.TENSORS.encode(values)

    @staticmethod
    def decode(arrays: Mapping[str, Array]) -> DecodeStep:
        reason = required(arrays, C.FINISH_REASON)[0].decode()
        tokens = [int(t) for t in required(arrays, C.TOKEN_IDS)]
        return DecodeStep(
            token_ids=tokens,
            finish_reason=reason or None,
            worker_pid=_first_int(arrays, C.WORKER_PID),
            num_cached_tokens=_first_int(arrays, C.NUM_CACHED_TOKENS),
            logprobs=_read_logprobs(arrays, len(tokens)),
        )

    @staticmethod
    def load(arrays: Mapping[str, Array]) -> tuple[int, ...] | None:
        """(running, waiting, free slots, free KV tokens), when the response carries it."""
        load = arrays.get(C.DECODE_LOAD)
        return None if load is None else tuple(int(x) for x in load.reshape(-1)[:4])
