"""The prefill model's side of the prefill pool's contract (codec.pools: PrefillCall in,
PrefillResponse out), and `KVLeaseServer`, which keeps payloads for decode servers elsewhere
to pull. Only the prefill model imports this."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg import contracts as C
from disagg import kvevents, kvnet
from disagg.cancel import CancelRegistry, Throttled
from disagg.codec.pools import PrefillCall, PrefillInput, PrefillResponse
from disagg.codec.tensors import Array
from disagg.kvnet import KVLeases, KVRef, KVServer
from disagg.triton.pb import input_arrays, tensors

if TYPE_CHECKING:
    from disagg.engine.prefill_engine import PrefillEngine
    from disagg.model_params import PrefillParams


def read_prefill_call(request: pb_utils.InferenceRequest) -> PrefillInput:
    """The prompt ids, sampling parameters and skip of an orchestrator's prefill call."""
    return PrefillCall.decode(input_arrays(request, PrefillCall.TENSORS.names))


def cancel_check(
    request: pb_utils.InferenceRequest, cancels: CancelRegistry, interval_s: float = 0.01
) -> Callable[[], bool]:
    """Whether the prefill of `request` should stop: Triton cancelled it (a gRPC caller's
    call was cancelled) or its id is marked in `cancels` (a BLS caller cannot cancel its
    call in Triton 2.51; the router marks its own id, which this one extends). Each answer
    costs an IPC or a stat, so it is asked at most every `interval_s`."""
    rid = request.request_id()
    return Throttled(lambda: bool(request.is_cancelled()) or cancels.is_marked(rid), interval_s)


def prefill_response(
    result: Any, payload: Array, pid: int, compute_us: int, start_ns: int, kv_start: int = 0
) -> pb_utils.InferenceResponse:
    """The prefill model's answer to a prefill call: `result` a PrefillResult (or
    TensorRT-LLM's), `payload` the KV payload's bytes (or a KVRef to them), which hold the
    prompt's K/V from position `kv_start` on."""
    arrays = PrefillResponse.encode(
        result.first_token, result.seed, payload, pid, compute_us, start_ns,
        getattr(result, "num_reused_tokens", 0), kv_start,
        getattr(result, "first_logprob", None),
    )  # fmt: skip
    return pb_utils.InferenceResponse(tensors(arrays))


class KVLeaseServer:
    """A prefill process's payloads for decode servers elsewhere: leased, served on a TCP
    port, answered with a reference (kvnet.py)."""

    def __init__(self, server: KVServer, advertise: str) -> None:
        self.server = server
        self.advertise = advertise

    @classmethod
    def start(
        cls,
        p: PrefillParams,
        args: dict[str, Any],
        on_change: Callable[[int], None] | None = None,
    ) -> KVLeaseServer:
        """`on_change`: told the bytes held after each lease, pull, drop or expiry."""
        # instance i of the pool takes kv_port + i (0: any free port, named in the reference)
        tail = str(args.get("model_instance_name", "")).rsplit("_", 1)[-1]  # prefill_0_<i>
        index = int(tail) if tail.isdigit() else 0
        port = p.kv_port + index if p.kv_port else 0
        leases = KVLeases(p.kv_lease_mb << 20, p.kv_lease_s, on_change)
        server = KVServer(leases, C.internal_token(), p.host, port).start()
        host = p.advertise_host or kvnet.advertise_host(p.host)
        if p.kv_advertise_port:
            return cls(server, f"{host}:{p.kv_advertise_port + index}")
        return cls(server, server.address(host))

    def lease(self, payload: Array) -> Array:
        handle = self.server.leases.put(payload)
        ref = KVRef(self.advertise, handle, payload.nbytes)
        return np.frombuffer(ref.to_bytes(), np.uint8)

    def drop(self, ref_payload: Array) -> bool:
        """Free the lease that `ref_payload` (what `lease` returned) names."""
        ref = KVRef.parse(np.ascontiguousarray(ref_payload, np.uint8).tobytes())
        return ref is not None and self.server.leases.drop(ref.handle)

    def close(self) -> None:
        self.server.close()


def publish_kv_events(
    p: PrefillParams, args: dict[str, Any], engine: PrefillEngine
) -> kvevents.Publisher | None:
    """This instance's prefix cache events for frontends elsewhere (None: kv_events_port 0
    or no prefix cache)."""
    return kvevents.publish(
        engine.kv_reuse, C.internal_token(), pool="prefill",
        instance_name=str(args.get("model_instance_name", "")), host=p.host,
        port=p.kv_events_port, block_size=engine.config.block_size,
        capacity_blocks=engine.config.num_prefix_cache_blocks,
    )  # fmt: skip
