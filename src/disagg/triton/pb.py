"""The one module of disagg that knows triton_python_backend_utils.

Reading request tensors into plain values, building responses, mapping disagg's error layers
onto Triton error codes, and the BLS implementations of the orchestrator's pool interfaces.
Imported only inside a Triton Python backend stub (where the module exists).
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg.cancel import CancelRegistry
from disagg.config import EngineConfig
from disagg.errors import CapacityError, EngineDeadError, KVPayloadError, RequestError
from disagg.sequence import SamplingParams
from disagg.triton import protocol as P
from disagg.triton.orchestrator import DecodeStep, Handoff, PoolError, Reply

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of a model's config.pbtxt, as strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def engine_config(p: dict[str, str]) -> EngineConfig:
    """The EngineConfig a model's parameters describe (max_num_seqs only for decode, whose
    KV cache is then touched at start: steady-state speed from the first request)."""
    extra = (
        {"max_num_seqs": int(p["max_num_seqs"]), "prefault_kv": True}
        if ("max_num_seqs" in p)
        else {}
    )
    return EngineConfig(
        max_model_len=int(p["max_model_len"]), max_tokens_limit=int(p["max_tokens_limit"]), **extra
    )


def set_torch_threads(p: dict[str, str]) -> None:
    """Threads for this model process; 0 or absent keeps torch's default (all cores)."""
    import torch

    if int(p.get("torch_threads", "0")) > 0:
        torch.set_num_threads(int(p["torch_threads"]))


def is_decoupled(args: dict) -> bool:
    return pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))


# ------------------------------------------------------------------ reading requests


def _array(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _one_item(name: str, arr: np.ndarray, batched: bool) -> np.ndarray:
    """Drop the batch dimension of a batched model's input, refusing batches above 1."""
    if batched:
        if arr.ndim == 0 or arr.shape[0] != 1:
            raise RequestError(f"{name}: batch size must be 1 (send one prompt per request)")
        arr = arr[0]
    return arr.reshape(-1)


def _text(value) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"text is not valid UTF-8: {e}") from e
    return str(value)


def read_fields(request, kinds: dict[str, str], batched: bool) -> dict:
    """Present inputs among `kinds` ({name: "str" | "strs" | "int" | "float" | "bool" |
    "ints"}) as plain Python values. Absent optional inputs are simply left out."""
    fields = {}
    for name, kind in kinds.items():
        arr = _array(request, name)
        if arr is None:
            continue
        flat = _one_item(name, arr, batched)
        if kind == "strs":
            fields[name] = [_text(v) for v in flat]
        elif kind == "ints":
            fields[name] = [int(v) for v in flat]
        elif flat.size != 1:
            raise RequestError(f"{name} must hold exactly one value, got {flat.size}")
        elif kind == "str":
            fields[name] = _text(flat[0])
        elif kind == "int":
            fields[name] = int(flat[0])
        elif kind == "float":
            fields[name] = float(flat[0])
        elif kind == "bool":
            fields[name] = bool(flat[0])
    return fields


# ------------------------------------------------------------------ responses


def tensor(name: str, value, dtype, batched: bool = False) -> pb_utils.Tensor:
    arr = np.asarray(value, dtype=dtype)
    arr = arr.reshape(-1)
    return pb_utils.Tensor(name, arr[None, :] if batched else arr)


def reply_response(reply: Reply, batched: bool) -> pb_utils.InferenceResponse:
    outputs = [
        tensor(P.TEXT_OUTPUT, [reply.text.encode("utf-8")], np.object_, batched),
        tensor(P.NUM_INPUT_TOKENS, [reply.num_input_tokens], np.int32, batched),
        tensor(P.NUM_OUTPUT_TOKENS, [reply.num_output_tokens], np.int32, batched),
        tensor(P.FINISH_REASON, [(reply.finish_reason or "").encode()], np.object_, batched),
    ]
    if reply.finish_reason is not None:
        outputs += [
            tensor(P.SERVED_BY, [reply.served_by.encode()], np.object_, batched),
            tensor(P.PREFILL_PID, [reply.prefill_pid], np.int32, batched),
            tensor(P.DECODE_PID, [reply.decode_pid], np.int32, batched),
            tensor(P.KV_BYTES, [reply.kv_bytes], np.int64, batched),
            tensor(P.KV_HANDOFF_US, [int(reply.kv_handoff_s * 1e6)], np.int64, batched),
        ]
    return pb_utils.InferenceResponse(output_tensors=outputs)


def error_code(exc: Exception):
    if isinstance(exc, RequestError):
        return pb_utils.TritonError.INVALID_ARG
    if isinstance(exc, (CapacityError, PoolError, EngineDeadError)):
        return pb_utils.TritonError.UNAVAILABLE
    return pb_utils.TritonError.INTERNAL


def error_response(exc: Exception) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), error_code(exc)))


def _raise_for(response, what: str) -> None:
    """Every BLS sub-response is checked: a client error stays a client error, anything else
    becomes a PoolError the orchestrator can route around."""
    if not response.has_error():
        return
    err = response.error()
    if err.code() == pb_utils.TritonError.INVALID_ARG:
        raise RequestError(err.message())
    raise PoolError(f"{what}: {err.message()}")


def _output(response, name: str) -> np.ndarray:
    t = pb_utils.get_output_tensor_by_name(response, name)
    if t is None:
        raise PoolError(f"response lacks output {name!r}")
    return t.as_numpy()


# ------------------------------------------------------------------ BLS pools


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
            ],
            timeout=self.timeout_us,
        )
        try:
            response = req.exec()
        except pb_utils.TritonModelException as e:  # model missing, not ready, timed out
            raise PoolError(f"prefill: {e}") from e
        _raise_for(response, "prefill")
        return Handoff(
            first_token=int(_output(response, P.FIRST_TOKEN)[0]),
            seed=int(_output(response, P.RESOLVED_SEED)[0]),
            kv_payload=_output(response, P.KV_PAYLOAD),
            worker_pid=int(_output(response, P.WORKER_PID)[0]),
            prefill_time_s=int(_output(response, P.PREFILL_TIME_US)[0]) / 1e6,
        )


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
            requested_output_names=[P.TOKEN_IDS, P.FINISH_REASON, P.WORKER_PID],
        )
        try:
            responses = req.exec(decoupled=True)
        except pb_utils.TritonModelException as e:
            raise PoolError(f"decode: {e}") from e
        # The iterator blocks forever if the decode process dies mid-stream, so it is read on a
        # helper thread while this one watches the worker's pid (sent in decode's first,
        # token-less response).
        events: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(responses, events), daemon=True).start()
        pid = 0
        while True:
            try:
                response = events.get(timeout=self.liveness_check_s)
            except queue.Empty:
                if pid and not process_alive(pid):
                    raise PoolError(f"decode worker {pid} died mid-request") from None
                continue
            if response is None:
                return
            if isinstance(response, Exception):
                raise PoolError(f"decode: {response}") from response
            _raise_for(response, "decode")
            if not response.output_tensors():  # the empty response that carries FINAL
                continue
            reason = _output(response, P.FINISH_REASON)[0].decode()
            pid = int(_output(response, P.WORKER_PID)[0])
            yield DecodeStep(
                token_ids=[int(t) for t in _output(response, P.TOKEN_IDS)],
                finish_reason=reason or None,
                worker_pid=pid,
            )

    def cancel(self, request_id: str) -> None:
        self.cancels.mark(request_id)


def _pump(responses, events: queue.Queue) -> None:
    try:
        for response in responses:
            events.put(response)
        events.put(None)
    except Exception as e:
        events.put(e)


def process_alive(pid: int) -> bool:
    """Whether a process on this host is running (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ------------------------------------------------------------------ decode responses


class SenderSink:
    """Decode output of one request, sent through its Triton response sender."""

    def __init__(self, sender, pid: int) -> None:
        self.sender = sender
        self.pid = pid

    def send(self, token_ids: list[int], finish_reason: str | None) -> None:
        response = pb_utils.InferenceResponse(
            output_tensors=[
                tensor(P.TOKEN_IDS, token_ids, np.int32),
                tensor(P.FINISH_REASON, [(finish_reason or "").encode()], np.object_),
                tensor(P.WORKER_PID, [self.pid], np.int32),
            ]
        )
        self.sender.send(response, flags=FINAL if finish_reason is not None else 0)

    def fail(self, error: Exception) -> None:
        self.sender.send(error_response(error), flags=FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def read_kv_handoff(request, request_id: str):
    """The decode model's view of an orchestrator request: (PrefillResult | None, prompt ids)."""
    from disagg.engine import PrefillResult
    from disagg.kv_payload import KVPayload

    payload = _array(request, P.KV_PAYLOAD)
    if payload is None:
        prompt = _array(request, P.PROMPT_IDS)
        if prompt is None:
            raise RequestError(f"give {P.KV_PAYLOAD} (with {P.FIRST_TOKEN}) or {P.PROMPT_IDS}")
        return None, [int(t) for t in prompt.reshape(-1)]
    first = _array(request, P.FIRST_TOKEN)
    seed = _array(request, P.RESOLVED_SEED)
    if first is None or seed is None:
        raise KVPayloadError(f"{P.KV_PAYLOAD} needs {P.FIRST_TOKEN} and {P.RESOLVED_SEED}")
    kv = KVPayload.from_bytes(payload.tobytes() if not payload.flags.c_contiguous else payload.data)
    return PrefillResult(
        request_id, int(first.reshape(-1)[0]), kv, int(seed.reshape(-1)[0]), 0.0
    ), None
