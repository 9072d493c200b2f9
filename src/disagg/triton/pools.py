"""The pools over BLS, each with both sides of its contract: what the orchestrator sends a
pool model and how it reads the answer, and what the pool model sends back.

    prefill:  BlsPrefillPool.prefill  ->  prefill model  ->  prefill_response
    decode:   BlsDecodePool.generate  ->  decode model (read_kv_handoff, SenderSink)
    router:   BlsLocalPipeline.generate  ->  orchestrator model (pb.reply_response)
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg import contracts as P
from disagg import kvnet
from disagg.cancel import CancelRegistry
from disagg.contracts import DecodeStep, Handoff, RoutedReply
from disagg.engine.sequence import SamplingParams
from disagg.errors import KVPayloadError, PoolError, RequestError
from disagg.kvnet import KVLeases, KVRef, KVServer
from disagg.pipeline.local import prefill_result
from disagg.triton.bls import BLS_PARAMETERS, CallerWatch, bls_stream, failure_response
from disagg.triton.pb import FINAL, input_array, output_array, raise_for_error, tensor

# ------------------------------------------------------------------ prefill


class BlsPrefillPool:
    """The prefill pool as the Triton model `model_name` in this server."""

    def __init__(self, model_name: str, timeout_s: float) -> None:
        self.model_name = model_name
        self.timeout_us = int(timeout_s * 1e6)

    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Handoff:
        req = pb_utils.InferenceRequest(
            model_name=self.model_name,
            request_id=request_id,
            inputs=[
                tensor(P.PROMPT_IDS, prompt_ids, np.int32),
                tensor(P.SAMPLING, [P.sampling_to_json(params).encode()], np.object_),
            ],
            requested_output_names=[
                P.FIRST_TOKEN,
                P.RESOLVED_SEED,
                P.KV_PAYLOAD,
                P.WORKER_PID,
                P.PREFILL_TIME_US,
                P.PREFILL_START_NS,
            ],
            timeout=self.timeout_us,
            parameters=BLS_PARAMETERS,
        )
        try:
            response = req.exec()
        except pb_utils.TritonModelException as e:  # model missing, not ready, timed out
            raise PoolError(f"prefill: {e}") from e
        raise_for_error(response, "prefill")
        return Handoff(
            first_token=int(output_array(response, P.FIRST_TOKEN)[0]),
            seed=int(output_array(response, P.RESOLVED_SEED)[0]),
            kv_payload=output_array(response, P.KV_PAYLOAD),
            worker_pid=int(output_array(response, P.WORKER_PID)[0]),
            prefill_time_s=int(output_array(response, P.PREFILL_TIME_US)[0]) / 1e6,
            start_wall_s=int(output_array(response, P.PREFILL_START_NS)[0]) / 1e9,
        )


def prefill_response(result, payload: np.ndarray, pid: int, compute_us: int, start_ns: int):
    """The prefill model's answer to BlsPrefillPool.prefill: `result` a PrefillResult (or
    TensorRT-LLM's), `payload` the KV payload's bytes."""
    return pb_utils.InferenceResponse(
        [
            tensor(P.FIRST_TOKEN, [result.first_token], np.int32),
            tensor(P.RESOLVED_SEED, [result.seed], np.uint64),
            pb_utils.Tensor(P.KV_PAYLOAD, payload),
            tensor(P.WORKER_PID, [pid], np.int32),
            tensor(P.PREFILL_TIME_US, [compute_us], np.int64),
            tensor(P.PREFILL_START_NS, [start_ns], np.int64),
        ]
    )


# ------------------------------------------------------------------ decode


class BlsDecodePool:
    """The decode pool as the decoupled Triton model `model_name` in this server."""

    def __init__(
        self, model_name: str, cancels: CancelRegistry, liveness_check_s: float = 1.0
    ) -> None:
        self.model_name = model_name
        self.cancels = cancels
        self.liveness_check_s = liveness_check_s

    def generate(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        handoff: Handoff | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[DecodeStep]:
        inputs = [tensor(P.SAMPLING, [P.sampling_to_json(params).encode()], np.object_)]
        if handoff is not None:
            inputs += [
                tensor(P.FIRST_TOKEN, [handoff.first_token], np.int32),
                tensor(P.RESOLVED_SEED, [handoff.seed], np.uint64),
                pb_utils.Tensor(P.KV_PAYLOAD, handoff.kv_payload),
            ]
        else:
            inputs.append(tensor(P.PROMPT_IDS, prompt_ids or [], np.int32))
        req = pb_utils.InferenceRequest(
            model_name=self.model_name,
            request_id=request_id,
            inputs=inputs,
            requested_output_names=[
                P.TOKEN_IDS,
                P.FINISH_REASON,
                P.WORKER_PID,
                P.ERROR_KIND,
                P.ERROR,
            ],
            parameters=BLS_PARAMETERS,
        )
        for response in bls_stream(req, "decode", self.liveness_check_s):
            if not response.output_tensors():  # the empty response that carries FINAL
                continue
            reason = output_array(response, P.FINISH_REASON)[0].decode()
            pid = int(output_array(response, P.WORKER_PID)[0])
            yield DecodeStep(
                token_ids=[int(t) for t in output_array(response, P.TOKEN_IDS)],
                finish_reason=reason or None,
                worker_pid=pid,
            )

    def cancel(self, request_id: str) -> None:
        self.cancels.mark(request_id)


class SenderSink:
    """Decode output of one request, sent through its Triton response sender."""

    def __init__(
        self,
        sender,
        pid: int,
        to_bls: bool = False,
        caller: CallerWatch | None = None,
        load=None,
    ) -> None:
        self.sender = sender
        self.pid = pid
        self.to_bls = to_bls  # failures as outputs (contracts.py): the caller is a BLS stream
        self.caller = caller or CallerWatch(0)
        self.load = load  # () -> (running, waiting, free slots, free KV tokens), if asked for
        self.num_sent = 0

    def send(self, token_ids: list[int], finish_reason: str | None) -> None:
        if self.caller.gone():  # DecodeService then finishes the request
            raise PoolError(f"the caller (pid {self.caller.pid}) died")
        outputs = [
            tensor(P.TOKEN_IDS, token_ids, np.int32),
            tensor(P.FINISH_REASON, [(finish_reason or "").encode()], np.object_),
            tensor(P.WORKER_PID, [self.pid], np.int32),
        ]
        if self.load is not None:
            outputs.append(tensor(P.DECODE_LOAD, list(self.load()), np.int32))
        response = pb_utils.InferenceResponse(output_tensors=outputs)
        self.sender.send(response, flags=FINAL if finish_reason is not None else 0)
        self.num_sent += 1

    def fail(self, error: Exception) -> None:
        """The final response of a failed request (errors after a first response to a BLS
        caller travel as outputs)."""
        as_outputs = self.to_bls and self.num_sent > 0
        self.sender.send(failure_response(error, as_outputs), flags=FINAL)

    def is_cancelled(self) -> bool:
        return self.caller.gone() or self.sender.is_cancelled()


class KVLeaseServer:
    """A prefill process's payloads for decode servers elsewhere: leased, served on a TCP
    port, answered with a reference (kvnet.py)."""

    def __init__(self, server: KVServer, advertise: str) -> None:
        self.server = server
        self.advertise = advertise

    @classmethod
    def start(cls, p, args) -> KVLeaseServer:
        # instance i of the pool takes kv_port + i (0: any free port, named in the reference)
        tail = str(args.get("model_instance_name", "")).rsplit("_", 1)[-1]  # prefill_0_<i>
        index = int(tail) if tail.isdigit() else 0
        port = p.kv_port + index if p.kv_port else 0
        leases = KVLeases(capacity_bytes=p.kv_lease_mb << 20, ttl_s=p.kv_lease_s)
        server = KVServer(leases, os.environ.get(P.TOKEN_ENV, ""), p.host, port).start()
        return cls(server, server.address(p.advertise_host or kvnet.advertise_host(p.host)))

    def lease(self, payload: np.ndarray) -> np.ndarray:
        handle = self.server.leases.put(payload)
        ref = KVRef(self.advertise, handle, payload.nbytes)
        return np.frombuffer(ref.to_bytes(), np.uint8)

    def close(self) -> None:
        self.server.close()


def resolve_kv_reference(data, timeout_s: float = 30.0):
    """A payload's bytes: `data` itself, or pulled from the prefill server it names."""
    ref = KVRef.parse(data)
    if ref is None:
        return data
    return kvnet.pull(ref, os.environ.get(P.TOKEN_ENV, ""), timeout_s).data


def read_kv_handoff(request, request_id: str):
    """The decode model's view of an orchestrator request: (PrefillResult | None, prompt ids)."""
    payload = input_array(request, P.KV_PAYLOAD)
    if payload is None:
        prompt = input_array(request, P.PROMPT_IDS)
        if prompt is None:
            raise RequestError(f"give {P.KV_PAYLOAD} (with {P.FIRST_TOKEN}) or {P.PROMPT_IDS}")
        return None, [int(t) for t in prompt.reshape(-1)]
    first = input_array(request, P.FIRST_TOKEN)
    seed = input_array(request, P.RESOLVED_SEED)
    if first is None or seed is None:
        raise KVPayloadError(f"{P.KV_PAYLOAD} needs {P.FIRST_TOKEN} and {P.RESOLVED_SEED}")
    data = payload.tobytes() if not payload.flags.c_contiguous else payload.data
    data = resolve_kv_reference(data)  # decode on another server than its prefill
    first_token, resolved = int(first.reshape(-1)[0]), int(seed.reshape(-1)[0])
    return prefill_result(request_id, first_token, resolved, data), None


# ------------------------------------------------------------------ router


# The orchestrator's inputs as the router forwards them (batched: [1, n]), by read kind.
_KIND_DTYPES = {
    "str": np.object_,
    "strs": np.object_,
    "int": np.int32,
    "ints": np.int32,
    "float": np.float32,
    "bool": np.bool_,
}
_ORCHESTRATOR_DTYPES = {
    P.INPUT_IDS: np.int32,
    **{name: _KIND_DTYPES[kind] for name, kind in P.GENERATION_INPUTS.items()},
    P.SEED: np.uint64,  # the one input wider than its read kind
}
_ORCHESTRATOR_OUTPUTS = [
    P.TEXT_OUTPUT,
    P.NUM_INPUT_TOKENS,
    P.NUM_OUTPUT_TOKENS,
    P.FINISH_REASON,
    P.SERVED_BY,
    P.WORKER_PID,
    P.ERROR_KIND,
    P.ERROR,
]


def _encode(value, dtype):
    values = value if isinstance(value, list) else [value]
    if dtype is np.object_:
        return [v.encode("utf-8") for v in values]
    return values


class BlsLocalPipeline:
    """The router's local target: an orchestrator model of this server, streamed over BLS.
    Cancellation marks the router's request id, which the orchestrator's id extends (see
    CancelRegistry), so decode stops that request at its next step."""

    def __init__(self, cancels: CancelRegistry) -> None:
        self.cancels = cancels

    def generate(self, model: str, request_id: str, fields: dict):
        dtypes = _ORCHESTRATOR_DTYPES
        inputs = [
            tensor(name, _encode(value, dtypes[name]), dtypes[name], batched=True)
            for name, value in fields.items()
        ]
        req = pb_utils.InferenceRequest(
            model_name=model,
            request_id=request_id,
            inputs=inputs,
            requested_output_names=_ORCHESTRATOR_OUTPUTS,
            parameters=BLS_PARAMETERS,
        )
        try:
            yield from self._replies(model, bls_stream(req, model))
        finally:
            self.cancels.clear(request_id)  # a mark, if any, has done its work

    @staticmethod
    def _replies(model: str, responses):

        for response in responses:
            if pb_utils.get_output_tensor_by_name(response, P.TEXT_OUTPUT) is None:
                continue  # the acknowledgement, or the empty response that carries FINAL
            reason = output_array(response, P.FINISH_REASON).reshape(-1)[0].decode()
            served = pb_utils.get_output_tensor_by_name(response, P.SERVED_BY)
            yield RoutedReply(
                text=output_array(response, P.TEXT_OUTPUT).reshape(-1)[0].decode("utf-8"),
                num_input_tokens=int(output_array(response, P.NUM_INPUT_TOKENS).reshape(-1)[0]),
                num_output_tokens=int(output_array(response, P.NUM_OUTPUT_TOKENS).reshape(-1)[0]),
                finish_reason=reason or None,
                served_by="" if served is None else served.as_numpy().reshape(-1)[0].decode(),
            )

    def cancel(self, request_id: str) -> None:
        self.cancels.mark(request_id)
