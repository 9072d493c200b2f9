"""The orchestrator's prefill and decode pools on other servers, over Triton's gRPC API.

Same contract as the pools over BLS (triton/pools.py): the same model inputs and outputs,
the internal token (shared by every server of a deployment: DISAGG_INTERNAL_TOKEN), failures
after the first response sent as outputs. What differs across hosts:

- the KV payload does not come back here: a prefill server in pull mode answers with a
  reference (kvnet.KVRef) and the decode server pulls the bytes from it;
- the caller's liveness is the gRPC stream itself: when this process dies its streams close,
  Triton cancels their requests and decode drops them; a stream that breaks is the callee
  gone (PoolError);
- a replica is chosen per request by load (replicas.ReplicaSet); prefill tries the next
  replica when one fails to answer, and raises PoolError when none does (the orchestrator
  then has decode prefill the prompt itself).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterator

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from disagg import contracts as P
from disagg.contracts import DecodeStep, Handoff
from disagg.engine.sequence import SamplingParams
from disagg.errors import PoolError
from disagg.remote.replicas import Replica, ReplicaSet

log = logging.getLogger("disagg.remote")
PREFILL_OUTPUTS = (
    P.FIRST_TOKEN, P.RESOLVED_SEED, P.KV_PAYLOAD, P.WORKER_PID, P.PREFILL_TIME_US,
    P.PREFILL_START_NS,
)  # fmt: skip
DECODE_OUTPUTS = (
    P.TOKEN_IDS, P.FINISH_REASON, P.WORKER_PID, P.ERROR_KIND, P.ERROR, P.DECODE_LOAD,
)  # fmt: skip
# gRPC status codes that mean "this replica did not take the request": try another
_UNREACHABLE = ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED", "StatusCode.CANCELLED")


def remote_parameters() -> dict:
    """What a cross-server call sends: the shared token, and the caller kind that has failures
    after the first response travel as outputs. No pid: the stream is the liveness."""
    return {P.CALLER_PARAM: P.BLS_CALLER, P.TOKEN_PARAM: os.environ.get(P.TOKEN_ENV, "")}


def _input(name: str, array: np.ndarray, dtype: str):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def _sampling(params: SamplingParams):
    return _input(P.SAMPLING, np.array([P.sampling_to_json(params).encode()], np.object_), "BYTES")


def _unreachable(e: InferenceServerException) -> bool:
    return any(code in str(e.status() or e) for code in _UNREACHABLE)


def _raise_for_outputs(result, what: str) -> None:
    kind = result.as_numpy(P.ERROR_KIND)
    if kind is None or not (k := kind.reshape(-1)[0].decode()):
        return
    message = result.as_numpy(P.ERROR)
    text = "" if message is None else message.reshape(-1)[0].decode("utf-8", "replace")
    raise P.error_from_kind(k, text or "failed", what)


def _raise_for_error(e: InferenceServerException, what: str):
    """A Triton error from the replica as our error (its kind travels in the message)."""
    kind, message = P.split_error(e.message() or str(e))
    raise P.error_from_kind(kind, message, what) from e


class ClientCache:
    """One gRPC client per replica address (channels are thread-safe and kept open)."""

    def __init__(self) -> None:
        self._clients: dict[str, grpcclient.InferenceServerClient] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpcclient.InferenceServerClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = grpcclient.InferenceServerClient(address)
            return client

    def probe(self, address: str, model: str) -> bool:
        try:
            return bool(self.get(address).is_model_ready(model, client_timeout=1.0))
        except Exception:
            return False


class GrpcPrefillPool:
    def __init__(
        self, replicas: str, model: str = "prefill", timeout_s: float = 60.0, tries: int = 2
    ) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self.tries = tries
        self.clients = ClientCache()
        self.replicas = ReplicaSet(replicas, probe=lambda a: self.clients.probe(a, model))

    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Handoff:
        tried: set[str] = set()
        last = "no prefill replica is up"
        for _ in range(self.tries):
            replica = self.replicas.choose(exclude=tried)
            if replica is None:
                break
            tried.add(replica.address)
            try:
                with self.replicas.using(replica):
                    return self._call(replica, request_id, prompt_ids, params)
            except InferenceServerException as e:
                if not _unreachable(e):
                    _raise_for_error(e, f"prefill at {replica.address}")
                self.replicas.eject(replica, str(e))
                last = f"prefill at {replica.address}: {e.message() or e}"
        raise PoolError(last)

    def _call(self, replica: Replica, request_id, prompt_ids, params) -> Handoff:
        result = self.clients.get(replica.address).infer(
            self.model,
            [_input(P.PROMPT_IDS, np.asarray(prompt_ids, np.int32), "INT32"), _sampling(params)],
            outputs=[grpcclient.InferRequestedOutput(n) for n in PREFILL_OUTPUTS],
            request_id=request_id,
            client_timeout=self.timeout_s,
            parameters=remote_parameters(),
        )

        def scalar(name: str) -> int:
            return int(result.as_numpy(name).reshape(-1)[0])

        return Handoff(
            first_token=scalar(P.FIRST_TOKEN),
            seed=scalar(P.RESOLVED_SEED),
            kv_payload=result.as_numpy(P.KV_PAYLOAD).reshape(-1),
            worker_pid=scalar(P.WORKER_PID),
            prefill_time_s=scalar(P.PREFILL_TIME_US) / 1e6,
            start_wall_s=scalar(P.PREFILL_START_NS) / 1e9,
        )


class GrpcDecodePool:
    """Each request is its own gRPC stream (a channel per replica, shared), so cancelling one
    (stop_stream with cancel_requests) ends only that request on the decode server."""

    def __init__(self, replicas: str, model: str = "decode", stall_s: float = 300.0) -> None:
        self.model = model
        self.stall_s = stall_s  # no response for this long: the replica is hung
        self.clients = ClientCache()
        self.replicas = ReplicaSet(replicas, probe=lambda a: self.clients.probe(a, model))
        self._streams: dict[str, grpcclient.InferenceServerClient] = {}
        self._lock = threading.Lock()

    def generate(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        handoff: Handoff | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[DecodeStep]:
        replica = self.replicas.choose()
        if replica is None:
            raise PoolError("decode: no decode replica is up")
        inputs = [_sampling(params)]
        if handoff is not None:
            inputs += [
                _input(P.FIRST_TOKEN, np.array([handoff.first_token], np.int32), "INT32"),
                _input(P.RESOLVED_SEED, np.array([handoff.seed], np.uint64), "UINT64"),
                _input(P.KV_PAYLOAD, np.asarray(handoff.kv_payload, np.uint8), "UINT8"),
            ]
        else:
            inputs.append(_input(P.PROMPT_IDS, np.asarray(prompt_ids or [], np.int32), "INT32"))
        with self.replicas.using(replica):
            yield from self._stream(replica, request_id, inputs)

    def _stream(self, replica: Replica, request_id: str, inputs) -> Iterator[DecodeStep]:
        what = f"decode at {replica.address}"
        events: queue.Queue = queue.Queue()
        # its own client: one stream per client in tritonclient; the channel is shared
        client = grpcclient.InferenceServerClient(replica.address)
        with self._lock:
            self._streams[request_id] = client
        try:
            client.start_stream(callback=lambda result, error: events.put((result, error)))
            client.async_stream_infer(
                self.model,
                inputs,
                outputs=[grpcclient.InferRequestedOutput(n) for n in DECODE_OUTPUTS],
                request_id=request_id,
                enable_empty_final_response=True,
                parameters=remote_parameters(),
            )
            while True:
                try:
                    result, error = events.get(timeout=self.stall_s)
                except queue.Empty:
                    self.replicas.eject(replica, "stalled")
                    raise PoolError(f"{what}: no response in {self.stall_s:.0f} s") from None
                if error is not None:
                    if _unreachable(error):
                        self.replicas.eject(replica, str(error))
                        raise PoolError(f"{what}: decode worker unreachable mid-request: "
                                        f"{error.message() or error}")  # fmt: skip
                    _raise_for_error(error, what)
                _raise_for_outputs(result, what)
                tokens = result.as_numpy(P.TOKEN_IDS)
                load = result.as_numpy(P.DECODE_LOAD)
                if load is not None:  # the server's whole load, other frontends' included
                    self.replicas.report(replica, *(int(x) for x in load.reshape(-1)[:4]))
                final = result.get_response().parameters.get("triton_final_response")
                if tokens is not None:
                    reason = result.as_numpy(P.FINISH_REASON).reshape(-1)[0].decode()
                    yield DecodeStep(
                        token_ids=[int(t) for t in tokens.reshape(-1)],
                        finish_reason=reason or None,
                        worker_pid=int(result.as_numpy(P.WORKER_PID).reshape(-1)[0]),
                    )
                if final is not None and final.bool_param:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            try:
                client.stop_stream(cancel_requests=True)
                client.close()
            except Exception as e:  # the stream may be broken already
                log.debug("closing the stream of %s: %s", request_id, e)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            client = self._streams.get(request_id)
        if client is not None:
            client.stop_stream(cancel_requests=True)
