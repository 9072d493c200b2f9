"""The orchestrator's pools over BLS, in this server: the caller's side of each pool's
contract (codec.pools). The pool models' sides are prefill_side.py and decode_side.py; the
same pools on other servers, over gRPC, are remote/pools.py.

    prefill:  BlsPrefillPool.prefill  ->  prefill model  (prefill_side.prefill_response)
    decode:   BlsDecodePool.generate  ->  decode model   (decode_side.SenderSink)
"""

from __future__ import annotations

from collections.abc import Iterator

import triton_python_backend_utils as pb_utils

from disagg.cancel import CancelRegistry
from disagg.codec.pools import DecodeCall, DecodeStepResponse, PrefillCall, PrefillResponse
from disagg.contracts import DecodeStep, Handoff
from disagg.engine.sequence import SamplingParams
from disagg.errors import PoolError
from disagg.triton.bls import BLS_PARAMETERS, bls_stream
from disagg.triton.pb import output_arrays, raise_for_error, tensors


class BlsPrefillPool:
    """The prefill pool as the Triton model `model_name` in this server."""

    def __init__(self, model_name: str, timeout_s: float) -> None:
        self.model_name = model_name
        self.timeout_us = int(timeout_s * 1e6)

    def prefill(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, skip_tokens: int = 0
    ) -> Handoff:
        req = pb_utils.InferenceRequest(
            model_name=self.model_name,
            request_id=request_id,
            inputs=tensors(PrefillCall.encode(prompt_ids, params, skip_tokens)),
            requested_output_names=list(PrefillResponse.TENSORS.names),
            timeout=self.timeout_us,
            parameters=BLS_PARAMETERS,
        )
        try:
            response = req.exec()
        except pb_utils.TritonModelException as e:  # model missing, not ready, timed out
            raise PoolError(f"prefill: {e}") from e
        raise_for_error(response, "prefill")
        return PrefillResponse.decode(output_arrays(response, PrefillResponse.TENSORS.names))


class BlsDecodePool:
    """The decode pool as the decoupled Triton model `model_name` in this server."""

    def __init__(
        self,
        model_name: str,
        cancels: CancelRegistry,
        liveness_check_s: float = 1.0,
        hang_s: float = 30.0,
        first_s: float = 30.0,
        stall_s: float = 300.0,
    ) -> None:
        """A stream whose decode process lives but says nothing ends with PoolError, as
        GrpcDecodePool's do: `first_s` without the acknowledgement decode sends as it takes
        a call (Triton handed it to an instance that will never run it: recovery calls
        again), `stall_s` from it to the first token (a slot, a prefill), `hang_s` between
        tokens (a live decode sends every step: the stream moves to another decode)."""
        self.model_name = model_name
        self.cancels = cancels
        self.liveness_check_s = liveness_check_s
        self.limits = {"first_s": first_s, "stall_s": stall_s, "hang_s": hang_s}
        # ids of the streams open now: only those are cancelled. A stream decode ended (a
        # failure, its death) has nothing to stop, and a first call carries the request's own
        # id, which the orchestrator's runner reads as "the client left" (runner.py): marked,
        # it would end a request that decode recovery is about to continue.
        self._open: set[str] = set()  # (one thread per request id: add/discard are atomic)

    def generate(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        handoff: Handoff | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[DecodeStep]:
        req = pb_utils.InferenceRequest(
            model_name=self.model_name,
            request_id=request_id,
            inputs=tensors(DecodeCall.encode(params, handoff, prompt_ids)),
            requested_output_names=DecodeStepResponse.requested(with_load=False),
            parameters=BLS_PARAMETERS,
        )
        names = DecodeStepResponse.TENSORS.names
        self._open.add(request_id)
        try:
            for response in bls_stream(req, "decode", self.liveness_check_s, **self.limits):
                arrays = output_arrays(response, names)
                if not arrays:  # the empty response that carries FINAL
                    continue
                yield DecodeStepResponse.decode(arrays)
        finally:  # (also when the failure propagates: before the caller sees it)
            self._open.discard(request_id)

    def cancel(self, request_id: str) -> None:
        if request_id in self._open:
            self.cancels.mark(request_id)
