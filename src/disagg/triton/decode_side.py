"""The decode model's side of the decode pool's contract (codec.pools: DecodeCall in,
DecodeStepResponse out): reading the call, pulling the KV payload from the prefill server
it names when decode runs on another server, and `SenderSink`, which sends each step. Only
the decode model imports this (docs/architecture.md: a router never loads decode code)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import triton_python_backend_utils as pb_utils

from disagg import contracts as C
from disagg import kvevents, kvnet, kvshm
from disagg.codec.pools import DecodeCall, DecodeStepResponse
from disagg.codec.tensors import Array
from disagg.engine.sequence import SamplingParams, TokenLogprob
from disagg.errors import PoolError
from disagg.kvnet import KVRef
from disagg.pipeline.local import prefill_result
from disagg.triton.bls import CallerWatch, failure_response
from disagg.triton.pb import FINAL, input_arrays, tensors

if TYPE_CHECKING:
    from disagg.engine.llm_engine import DecodeEngine, PrefillResult
    from disagg.model_params import DecodeParams


def resolve_kv_reference(data: bytes | memoryview, timeout_s: float = 30.0) -> Any:
    """A payload's bytes: `data` itself, the shared-memory file it names (a prefill in this
    server: kvshm.py), or pulled from the prefill server it names (kvnet.py)."""
    if (local := kvshm.ShmRef.parse(data)) is not None:
        return kvshm.open_payload(local)
    ref = KVRef.parse(data)
    if ref is None:
        return data
    return kvnet.pull(ref, C.internal_token(), timeout_s).data


def read_decode_call(
    request: pb_utils.InferenceRequest, request_id: str
) -> tuple[SamplingParams, PrefillResult | None, list[int] | None]:
    """The decode model's view of an orchestrator request: (sampling parameters, the
    PrefillResult of its hand-off or None, the prompt ids: to prefill, or naming the
    hand-off's K/V; None when not sent)."""
    call = DecodeCall.decode(input_arrays(request, DecodeCall.TENSORS.names))
    if call.kv_payload is None:
        return call.params, None, call.prompt_ids
    payload: Array = call.kv_payload
    data = payload.tobytes() if not payload.flags.c_contiguous else payload.data
    data = resolve_kv_reference(data)  # decode on another server than its prefill
    prefill = prefill_result(request_id, call.first_token, call.seed, data)
    return call.params, prefill, call.prompt_ids


class SenderSink:
    """Decode output of one request, sent through its Triton response sender."""

    def __init__(
        self,
        sender: pb_utils.InferenceResponseSender,
        pid: int,
        to_bls: bool = False,
        caller: CallerWatch | None = None,
        load: Callable[[], tuple[int, int, int, int]] | None = None,
    ) -> None:
        self.sender = sender
        self.pid = pid
        self.to_bls = to_bls  # failures as outputs (contracts.py): the caller is a BLS stream
        self.caller = caller or CallerWatch(0)
        self.load = load  # () -> (running, waiting, free slots, free KV tokens), if asked for
        self.num_sent = 0

    def send(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        num_cached_tokens: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        if self.caller.gone():  # DecodeService then finishes the request
            raise PoolError(f"the caller (pid {self.caller.pid}) died")
        load = None if self.load is None else self.load()
        arrays = DecodeStepResponse.encode(
            token_ids, finish_reason, self.pid, load, num_cached_tokens, logprobs
        )
        response = pb_utils.InferenceResponse(output_tensors=tensors(arrays))
        self.sender.send(response, flags=FINAL if finish_reason is not None else 0)
        self.num_sent += 1

    def fail(self, error: Exception) -> None:
        """The final response of a failed request (errors after a first response to a BLS
        caller travel as outputs)."""
        as_outputs = self.to_bls and self.num_sent > 0
        self.sender.send(failure_response(error, as_outputs), flags=FINAL)

    def is_cancelled(self) -> bool:
        return bool(self.caller.gone() or self.sender.is_cancelled())


def heartbeat(engine: DecodeEngine, slots: int, kv_bytes_per_token: int) -> dict[str, int]:
    """The decode engine's load, for the frontends' replica choice (remote/cache_route.py)."""
    s = engine.stats()
    load = {"running": s.num_running, "waiting": s.num_waiting, "slots": slots}
    if s.kv_bytes_reserved is not None and s.kv_bytes_capacity is not None:
        load["kv_used_tokens"] = s.kv_bytes_reserved // kv_bytes_per_token
        load["kv_capacity_tokens"] = s.kv_bytes_capacity // kv_bytes_per_token
    return load


def publish_kv_events(
    p: DecodeParams, args: dict[str, Any], engine: DecodeEngine, kv_bytes_per_token: int
) -> kvevents.Publisher | None:
    """This instance's prefix cache events and load for frontends elsewhere (None:
    kv_events_port 0, or no prefix cache)."""
    config = p.engine_config()
    return kvevents.publish(
        getattr(engine, "kv_reuse", None), C.internal_token(), pool="decode",
        instance_name=str(args.get("model_instance_name", "")), host=p.host,
        port=p.kv_events_port, block_size=config.block_size,
        capacity_blocks=config.num_prefix_cache_blocks,
        load=lambda: heartbeat(engine, p.decode_max_num_seqs, kv_bytes_per_token),
    )  # fmt: skip
