"""The gateway's view of Triton: one streaming call of the `router` model over gRPC.

Errors come back as messages only on a gRPC stream; disagg's models tag them with their kind
(contracts.tag_error), which maps them to HTTP codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from disagg import contracts as C
from disagg.codec.generate import RouterReply, RouterRequest
from disagg.codec.tensors import gather, triton_dtype
from disagg.gateway.errors import APIError
from disagg.hold import Hold
from disagg.process import process_alive, stub_args


@dataclass
class Piece:
    """One response of the router: a text delta, and on the last one the finish reason."""

    text: str
    num_input_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    extra: dict[str, str] = field(default_factory=dict)
    num_cached_tokens: int = 0  # on the last: prompt tokens a prefix cache gave
    # with logprobs asked for: this piece's tokens as OpenAI's chat logprobs objects
    logprobs: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an endpoint's tool-call deltas, relayed


def _inputs(fields: dict[str, Any]) -> list[grpcclient.InferInput]:
    """The router's inputs (codec.generate.RouterRequest) as tritonclient inputs."""
    inputs = []
    for name, arr in RouterRequest.encode(fields).items():
        t = grpcclient.InferInput(name, list(arr.shape), triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def _piece(result: grpcclient.InferResult) -> Piece:
    """One router response (codec.generate.RouterReply)."""
    arrays = gather(result.as_numpy, RouterReply.TENSORS.names)
    reply = RouterReply.decode(arrays)
    return Piece(
        text=reply.text,
        num_input_tokens=reply.num_input_tokens,
        num_output_tokens=reply.num_output_tokens,
        finish_reason=reply.finish_reason,
        extra=RouterReply.extras(arrays),
        num_cached_tokens=reply.num_cached_tokens,
        logprobs=reply.logprobs,
        tool_calls=reply.tool_calls,
    )


# Triton's own words for a model it holds no ready instance of: the registry resolved the
# name, so the model is there but reloading (its stub died; the supervisor restarts it), or
# its stub died a moment ago and the reload has not begun ("Stub process 'router_0_0' is not
# healthy": the request was refused, not run)
_RELOADING = ("has no available versions", "is not ready", "is not healthy")


def api_error(message: str) -> APIError:
    kind, text = C.split_error(message)
    if kind is C.ErrorKind.INVALID_REQUEST:
        return APIError(400, text)
    if kind is C.ErrorKind.UNAVAILABLE or any(words in text for words in _RELOADING):
        return APIError(503, text, type_="server_error", code="model_unavailable")
    return APIError(500, text, type_="server_error")


async def _guarded(call: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The call's responses, with transport failures (Triton down or restarting, the stream
    timing out) turned into OpenAI-format 503 / 504 errors."""
    try:
        async for item in call:
            yield item
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise APIError(
                504, "the model did not finish in time", "server_error", code="timeout"
            ) from None
        raise APIError(
            503,
            f"the inference server is unavailable ({e.code().name})",
            "server_error",
            code="unavailable",
        ) from None


async def _finish(call: Any) -> None:  # tritonclient's stream call: untyped
    """Let a completed stream end normally. A call dropped while open is cancelled when it is
    collected; a cancel reaching Triton after its request completed is a known race in the
    server (triton-inference-server/server#8034), so only clients that really go away cause
    a cancel."""
    try:
        async with asyncio.timeout(5):
            async for _ in call:
                pass
    except (StopAsyncIteration, TimeoutError, grpc.RpcError):
        call.cancel()
    except Exception:
        pass


RETRY_S = 5.0  # how long a request waits for an unreachable Triton (restarting) before 503
WATCH_S = 0.5  # how often a request's router process is checked while it waits for a response
ACK_S = 60.0  # no response at all this long after sending: the router's process died first
ACKING = frozenset({"router"})  # the models that acknowledge with their pid when asked


def watchable(pid: int) -> bool:
    """Whether `pid` is a Python backend stub this process can see: the acknowledgement's
    pid means nothing where Triton runs in another pid namespace (a container beside the
    gateway), and is then not watched."""
    return stub_args(pid) is not None


def is_local(url: str) -> bool:
    """Whether `url` ("host:port") is on this host: an address this host can bind."""
    host = url.rsplit(":", 1)[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr[0], 0))
            return True
    return False


def _ack_pid(result: grpcclient.InferResult) -> int | None:
    """The router process's pid, if `result` is its acknowledgement (contracts.ACK_PARAM)."""
    pid = result.as_numpy(C.WORKER_PID)
    return None if pid is None else int(pid.reshape(-1)[0])


async def _watched(items: AsyncIterator[Any], pid: list[int]) -> AsyncIterator[Any]:
    """`items`, ended with a 503 when the router process serving them dies (`pid[0]` > 0,
    set by the caller from the acknowledgement; -1: not watchable) or nothing at all comes
    back in ACK_S: Triton 2.51 never ends the requests of a dead stub, so without this the
    client would wait for good."""
    it = aiter(items)
    loop = asyncio.get_running_loop()
    sent, answered = loop.time(), False
    nxt: asyncio.Future[Any] = asyncio.ensure_future(anext(it))
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=WATCH_S)
            if nxt in done:
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                answered = True
                yield item
                nxt = asyncio.ensure_future(anext(it))
            elif pid[0] > 0 and not process_alive(pid[0]):
                raise APIError(
                    503, f"the router process ({pid[0]}) serving this request died",
                    "server_error", code="unavailable",
                )  # fmt: skip
            elif not answered and loop.time() - sent > ACK_S:
                raise APIError(
                    503, f"the router did not take the request within {ACK_S:.0f} s",
                    "server_error", code="unavailable",
                )  # fmt: skip
    finally:
        nxt.cancel()


class TritonBackend:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        # Triton on this host: watch the router process of each request (its pid means
        # nothing on another host, where a dead stub's requests still hang: Triton's own)
        self.watch = is_local(url)
        self._client: grpcaio.InferenceServerClient | None = None
        # metrics: a request tried again (Triton unreachable); held back (+1) and let go (-1)
        self.on_retry: Callable[[], None] = lambda: None
        self.on_hold: Callable[[int], None] = lambda _: None
        self.hold: Hold | None = None  # a planned restart of Triton holds new requests

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        if self._client is None:  # created inside the server's event loop
            # reconnect quickly after Triton restarts (gRPC's default backoff grows to 2 min)
            self._client = grpcaio.InferenceServerClient(
                self.url,
                channel_args=[
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
        return self._client

    async def held_back(self) -> None:
        """While a planned restart of Triton holds new requests (disagg/hold.py), wait; a
        request calls this once, before it counts as in flight (the restart waits for those)."""
        if self.hold is None or not self.hold.active():
            return
        self.on_hold(1)
        try:
            await self.hold.wait()
        finally:
            self.on_hold(-1)

    async def is_server_ready(self) -> bool:
        """Triton's own readiness: with --strict-readiness, every model is READY (a model
        reloading after its stub died is not)."""
        try:
            return bool(await self.client.is_server_ready())
        except Exception:
            return False

    async def is_ready(self, model: str) -> bool:
        try:
            return bool(await self.client.is_model_ready(model))
        except Exception:
            return False

    async def generate(
        self, model: str, version: str, request_id: str, inputs: dict[str, Any]
    ) -> AsyncGenerator[Piece, None]:
        """Stream the router's responses; closing this generator cancels the request in
        Triton (and, through the router, frees its decode slot). A request Triton could not
        be reached for (nothing came back yet) is tried again for up to RETRY_S: the server
        may be restarting, and the request never reached it, so nothing is duplicated. So is
        one whose router process died before any text came back (`_watched`): the orchestrator
        drops a dead caller's requests, so nothing is duplicated either."""
        deadline = asyncio.get_running_loop().time() + RETRY_S
        while True:
            pieces = self._generate_once(model, version, request_id, inputs)
            try:
                first = await anext(pieces)
            except APIError as e:
                if e.code != "unavailable" or asyncio.get_running_loop().time() > deadline:
                    raise
                self.on_retry()
                await asyncio.sleep(0.25)
                continue
            except StopAsyncIteration:
                return
            break
        try:
            yield first
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()

    async def _generate_once(
        self, model: str, version: str, request_id: str, inputs: dict[str, Any]
    ) -> AsyncGenerator[Piece, None]:

        watch = self.watch and model in ACKING  # (a router this host runs)

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield {
                "model_name": model,
                "model_version": version,
                "inputs": _inputs({**inputs, C.STREAM: True}),
                "request_id": request_id,
                "enable_empty_final_response": True,
                **({"parameters": {C.ACK_PARAM: True}} if watch else {}),
            }

        call = self.client.stream_infer(one_request(), stream_timeout=self.timeout_s)
        done = False  # the final response arrived (or an error): nothing left to cancel
        pid = [0]  # the router process serving it, from its acknowledgement
        responses = _watched(_guarded(call), pid) if watch else _guarded(call)
        try:
            async for result, error in responses:
                if error is not None:
                    done = True
                    raise api_error(str(error))
                if pid[0] == 0 and (ack := _ack_pid(result)) is not None:
                    pid[0] = ack if watchable(ack) else -1
                    continue
                piece = _piece(result)
                params = result.get_response().parameters
                final = params.get("triton_final_response")
                if final is not None and final.bool_param:
                    # end the RPC before the caller sees the last piece: a caller that stops
                    # reading after it (a client closing after [DONE]) must not leave an open
                    # call behind to be cancelled
                    done = True
                    await _finish(call)
                if piece.text or piece.finish_reason or piece.tool_calls or piece.logprobs:
                    yield piece
                if done:
                    return
        finally:
            if not done:
                call.cancel()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
