"""The orchestrator's prefill and decode pools on other servers, over Triton's gRPC API.

Same contract as the pools over BLS (triton/pools.py): the same messages (codec/pools.py),
the internal token (shared by every server of a deployment: DISAGG_INTERNAL_TOKEN), failures
after the first response sent as outputs. What differs across hosts:

- the KV payload does not come back here: a prefill server in pull mode answers with a
  reference (kvnet.KVRef) and the decode server pulls the bytes from it;
- the caller's liveness is the gRPC stream itself: when this process dies its streams close,
  Triton cancels their requests and decode drops them; a stream that breaks is the callee
  gone (PoolError);
- a replica is chosen per request by the prompt blocks each holds and its load
  (cache_route.py: from the KV events the replicas publish, followed from here), or by load
  alone (replicas.ReplicaSet); prefill tries the next replica when one fails to answer, and
  raises PoolError when none does (the orchestrator then has decode prefill the prompt);
- decode is placed before prefill runs (`place`), so the hand-off may leave out what that
  replica holds; a replica that lacks it after all answers with a prefix miss, and the
  whole prompt's K/V goes to the same replica (a miss is an answer, not an unreachable
  replica: it is never ejected for one).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
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
from disagg.errors import KVPrefixMissError, PoolError, RequestCancelledError
from disagg.pipeline.handoff import release
from disagg.remote.cache_route import Follower, PromptKey, RouteParams
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
    """The replica did not take the request. A model's prefix miss or failed KV pull is its
    answer, whatever status carries it (UNAVAILABLE): never a reason to eject it."""
    if C.split_error(e.message() or str(e))[0] in (C.PREFIX_MISS, C.ErrorKind.KV_TRANSFER):
        return False
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

    def events_port(self, address: str, model: str) -> tuple[int, int] | None:
        """(where the replica's `model` publishes KV events, 0: nowhere; its instance count)
        from the model's config, or None while it does not answer."""
        try:
            config = self.get(address).get_model_config(model, as_json=True, client_timeout=2.0)
        except Exception:
            return None
        config = config.get("config", {})
        port = config.get("parameters", {}).get("kv_events_port", {}).get("string_value", "0")
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", []))
        return int(port or 0), max(instances, 1)


def replica_set(
    spec: str, clients: ClientCache, model: str, route: RouteParams | None, decode: bool = False
) -> ReplicaSet:
    """A pool's replicas, each followed by its KV events when the route asks for them."""

    def probe(address: str) -> bool:
        return clients.probe(address, model)

    def discover(address: str) -> tuple[int, int] | None:
        return clients.events_port(address, model)

    def follow(r: Replica, lost: Callable[[str], None]) -> Follower:
        return Follower(r.address, r.cache, discover, C.internal_token(), lost).start()

    events = route is not None and route.events
    return ReplicaSet(
        spec, probe=probe, route=route, follow=follow if events else None, decode=decode
    )


def _key(prompt_ids: list[int] | None, params: SamplingParams) -> PromptKey | None:
    """The prompt as replicas' caches know it; None where the cache is not to be used."""
    return PromptKey(prompt_ids, params.cache_salt) if prompt_ids and params.use_cache else None


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
        route: RouteParams | None = None,
    ) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self.tries = tries
        self.cancels = cancels
        self.cancel_poll_s = cancel_poll_s
        self.clients = ClientCache()
        self.replicas = replica_set(replicas, self.clients, model, route)

    def prefill(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, skip_tokens: int = 0
    ) -> Handoff:
        tried: set[str] = set()
        last = "no prefill replica is up"
        key = _key(prompt_ids, params)
        for _ in range(self.tries):
            choice = self.replicas.choose_for(key, exclude=tried)
            if choice is None:
                break
            replica = choice.replica
            tried.add(replica.address)
            try:
                work = len(prompt_ids) - int(choice.held.expected)  # what it has to compute
                with self.replicas.using(replica, work):
                    handoff = self._call(replica, request_id, prompt_ids, params, skip_tokens)
                if key is not None:
                    replica.cache.record(key)
                return handoff
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
                    call.cancel()
                    self._release_late_reply(done, names)
                    raise RequestCancelledError(
                        f"prefill at {replica.address} cancelled: the client went away"
                    ) from None
        if error is not None:
            raise error
        return PrefillResponse.decode(_arrays(result, names))

    def _release_late_reply(
        self, done: queue.Queue[Any], names: tuple[str, ...], wait_s: float = 0.2
    ) -> None:
        """A reply already on its way when the call was cancelled still arrives: its lease is
        dropped rather than left to the TTL (the prefill model drops one it made for a caller
        it saw leave; this covers the moment between its last look and its reply)."""
        try:
            result, error = done.get(timeout=wait_s)
        except queue.Empty:
            return
        if error is None and result is not None:
            try:
                release(PrefillResponse.decode(_arrays(result, names)).kv_payload)
            except Exception as e:  # best effort: the TTL frees it otherwise
                log.info("late prefill reply not released: %s", e)


class GrpcDecodePool:
    """Each request is its own gRPC stream (a channel per replica, shared), so cancelling one
    (stop_stream with cancel_requests) ends only that request on the decode server."""

    MAX_PLACED = 4096  # placements kept for requests that never came to decode

    def __init__(
        self,
        replicas: str,
        model: str = "decode",
        stall_s: float = 300.0,
        route: RouteParams | None = None,
        hang_s: float = 30.0,
    ) -> None:
        """A stream that has had no response for `stall_s` (before its first token: it may
        wait for a slot or prefill a long prompt there) or `hang_s` (after: a live replica
        sends every step, a second or two apart at worst) ends with PoolError and its
        replica is ejected: the orchestrator moves the stream to another replica. A frozen or
        partitioned node is found this way; a dead one sooner, by its broken connection."""
        self.model = model
        self.stall_s = stall_s
        self.hang_s = hang_s
        self.clients = ClientCache()
        self.replicas = replica_set(replicas, self.clients, model, route, decode=True)
        self._streams: dict[str, grpcclient.InferenceServerClient] = {}
        self._placed: OrderedDict[str, Replica] = OrderedDict()  # request id -> its replica
        self._lock = threading.Lock()

    def place(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> int:
        """Choose the replica that will decode this request now, before its prefill: the
        leading prompt tokens it surely holds (the hand-off may leave them out)."""
        choice = self.replicas.choose_for(_key(prompt_ids, params))
        if choice is None:
            return 0
        self._pin(request_id, choice.replica)
        return choice.held.sure

    def _pin(self, request_id: str, replica: Replica) -> None:
        with self._lock:
            self._placed[request_id] = replica
            while len(self._placed) > self.MAX_PLACED:
                self._placed.popitem(last=False)

    def _replica_for(self, request_id: str, key: PromptKey | None) -> Replica:
        with self._lock:
            placed = self._placed.pop(request_id, None)
        if (
            placed is not None
            and placed.ejected_until == 0.0
            and any(r is placed for r in self.replicas.replicas)  # (not gone from DNS since)
        ):
            return placed
        choice = self.replicas.choose_for(key)
        if choice is None:
            raise PoolError("decode: no decode replica is up")
        return choice.replica

    def generate(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        handoff: Handoff | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[DecodeStep]:
        key = _key(prompt_ids, params)
        replica = self._replica_for(request_id, key)
        inputs = grpc_inputs(DecodeCall.encode(params, handoff, prompt_ids))
        tokens = [handoff.first_token] if handoff is not None else []
        work = len(prompt_ids or ()) + params.max_tokens  # the KV it reserves there
        with self.replicas.using(replica, work):
            try:
                for step in self._stream(replica, request_id, inputs):
                    tokens += step.token_ids
                    yield step
            except KVPrefixMissError:
                if key is not None:
                    replica.cache.forget(key)
                self._pin(request_id, replica)  # the whole prompt's K/V goes to it next
                raise
        if key is not None and prompt_ids:  # its K/V: the prompt and all but the last token
            replica.cache.record(PromptKey(prompt_ids + tokens[:-1], params.cache_salt))

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
            started = False  # its tokens began: silence now means a hung replica
            while True:
                wait = self.hang_s if started else self.stall_s
                try:
                    result, error = events.get(timeout=wait)
                except queue.Empty:
                    self.replicas.eject(replica, "hung" if started else "stalled")
                    after = " after its tokens began (hung)" if started else ""
                    raise PoolError(f"{what}: no response in {wait:g} s{after}") from None
                if error is not None:
                    if _unreachable(error):  # (a prefix miss never is)
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
                    step = DecodeStepResponse.decode(arrays)
                    started = started or bool(step.token_ids)
                    yield step
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
            self._placed.pop(request_id, None)
            client = self._streams.get(request_id)
        if client is not None:
            client.stop_stream(cancel_requests=True)
