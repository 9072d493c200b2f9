"""The orchestrator's prefill and decode pools on other servers, over Triton's gRPC API.

Same contract as the pools over BLS (triton/pools.py): the same messages (codec/pools.py),
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
import queue
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

import grpc
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from disagg import contracts as C
from disagg.cancel import CancelRegistry
from disagg.codec.pools import DecodeCall, DecodeStepResponse, PrefillCall, PrefillResponse
from disagg.codec.tensors import Arrays, gather, raise_for_failure, triton_dtype
from disagg.contracts import DecodeStep, Handoff
from disagg.engine.sequence import SamplingParams
from disagg.errors import PoolError, RequestCancelledError
from disagg.remote.replicas import Replica, ReplicaSet

log = logging.getLogger("disagg.remote")
# gRPC status codes that mean "this replica did not take the request": try another
_UNREACHABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# tritonclient keeps a failed call's status as str(grpc.StatusCode.X) ("StatusCode.UNAVAILABLE")
_STATUS_CODES = {str(code): code for code in grpc.StatusCode}


def remote_parameters() -> dict[str, str]:
    """What a cross-server call sends: the shared token, and the caller kind that has failures
    after the first response travel as outputs. No pid: the stream is the liveness."""
    return {C.CALLER_PARAM: C.BLS_CALLER, C.TOKEN_PARAM: C.internal_token()}


def grpc_inputs(arrays: Arrays) -> list[grpcclient.InferInput]:
    """A codec message's arrays as tritonclient inputs."""
    inputs = []
    for name, array in arrays.items():
        t = grpcclient.InferInput(name, list(array.shape), triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        inputs.append(t)
    return inputs


def grpc_status(e: InferenceServerException) -> grpc.StatusCode | None:
    """The gRPC status of a failed call; None for an error a model sent inside a stream (a
    stream's error response carries a message only)."""
    return _STATUS_CODES.get(e.status() or "")


def _unreachable(e: InferenceServerException) -> bool:
    return grpc_status(e) in _UNREACHABLE


def _raise_for_error(e: InferenceServerException, what: str) -> NoReturn:
    """A Triton error from the replica as our error (its kind travels in the message)."""
    kind, message = C.split_error(e.message() or str(e))
    raise C.error_from_kind(kind, message, what) from e


def _arrays(result: Any, names: tuple[str, ...]) -> Arrays:
    return gather(result.as_numpy, names)


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
    """With `cancels`, a call whose request is marked cancelled there (its client left) is
    cancelled in gRPC, which Triton passes to the prefill model: it stops at its next layer
    (engine/prefill_engine.py) and takes the next request."""

    def __init__(
        self,
        replicas: str,
        model: str = "prefill",
        timeout_s: float = 60.0,
        tries: int = 2,
        cancels: CancelRegistry | None = None,
        cancel_poll_s: float = 0.02,
    ) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self.tries = tries
        self.cancels = cancels
        self.cancel_poll_s = cancel_poll_s
        self.clients = ClientCache()
        self.replicas = ReplicaSet(replicas, probe=lambda a: self.clients.probe(a, model))

    def prefill(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, skip_tokens: int = 0
    ) -> Handoff:
        tried: set[str] = set()
        last = "no prefill replica is up"
        for _ in range(self.tries):
            replica = self.replicas.choose(exclude=tried)
            if replica is None:
                break
            tried.add(replica.address)
            try:
                with self.replicas.using(replica):
                    return self._call(replica, request_id, prompt_ids, params, skip_tokens)
            except InferenceServerException as e:
                if not _unreachable(e):
                    _raise_for_error(e, f"prefill at {replica.address}")
                self.replicas.eject(replica, str(e))
                last = f"prefill at {replica.address}: {e.message() or e}"
        raise PoolError(last)

    def _call(
        self,
        replica: Replica,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        skip_tokens: int,
    ) -> Handoff:
        names = PrefillResponse.TENSORS.names
        done: queue.Queue[tuple[Any, InferenceServerException | None]] = queue.Queue()
        call = self.clients.get(replica.address).async_infer(
            self.model,
            grpc_inputs(PrefillCall.encode(prompt_ids, params, skip_tokens)),
            callback=lambda result, error: done.put((result, error)),
            outputs=[grpcclient.InferRequestedOutput(n) for n in names],
            request_id=request_id,
            client_timeout=self.timeout_s,
            parameters=remote_parameters(),
        )
        while True:
            try:
                result, error = done.get(timeout=self.cancel_poll_s)
                break
            except queue.Empty:
                if self.cancels is not None and self.cancels.is_marked(request_id):
                    # a lease the prefill made as this was cancelled is lost with its reply
                    # (a window of milliseconds): the lease's TTL frees that one
                    call.cancel()
                    raise RequestCancelledError(
                        f"prefill at {replica.address} cancelled: the client went away"
                    ) from None
        if error is not None:
            raise error
        return PrefillResponse.decode(_arrays(result, names))


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
        inputs = grpc_inputs(DecodeCall.encode(params, handoff, prompt_ids))
        with self.replicas.using(replica):
            yield from self._stream(replica, request_id, inputs)

    def _stream(
        self, replica: Replica, request_id: str, inputs: list[grpcclient.InferInput]
    ) -> Iterator[DecodeStep]:
        what = f"decode at {replica.address}"
        names = DecodeStepResponse.requested(with_load=True)
        events: queue.Queue[tuple[Any, InferenceServerException | None]] = queue.Queue()
        # its own client: one stream per client in tritonclient; the channel is shared
        client = grpcclient.InferenceServerClient(replica.address)
        with self._lock:
            self._streams[request_id] = client
        try:
            client.start_stream(callback=lambda result, error: events.put((result, error)))
            client.async_stream_infer(
                self.model,
                inputs,
                outputs=[grpcclient.InferRequestedOutput(n) for n in names],
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
                arrays = _arrays(result, tuple(names))
                raise_for_failure(arrays, what)
                load = DecodeStepResponse.load(arrays)
                if load is not None:  # the server's whole load, other frontends' included
                    self.replicas.report(replica, *load)
                final = result.get_response().parameters.get("triton_final_response")
                if C.TOKEN_IDS in arrays:  # not the empty response that carries FINAL
                    yield DecodeStepResponse.decode(arrays)
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
