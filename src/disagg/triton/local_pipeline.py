"""The router's local target over BLS: the caller's side of the orchestrator's contract
(codec.generate: OrchestratorRequest in, OrchestratorReply out). The router's process loads
this and none of the pools' code (tests/unit/test_layout.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import triton_python_backend_utils as pb_utils

from disagg.cancel import CancelRegistry
from disagg.codec.generate import OrchestratorReply, OrchestratorRequest
from disagg.contracts import RoutedReply
from disagg.triton.bls import BLS_PARAMETERS, bls_stream
from disagg.triton.pb import output_arrays, tensors


class BlsLocalPipeline:
    """The router's local target: an orchestrator model of this server, streamed over BLS.
    Cancellation marks the router's request id, which the orchestrator's id extends (see
    CancelRegistry), so decode stops that request at its next step."""

    def __init__(self, cancels: CancelRegistry) -> None:
        self.cancels = cancels

    def generate(
        self, model: str, request_id: str, fields: dict[str, Any]
    ) -> Iterator[RoutedReply]:
        req = pb_utils.InferenceRequest(
            model_name=model,
            request_id=request_id,
            inputs=tensors(OrchestratorRequest.encode(fields)),
            requested_output_names=list(OrchestratorReply.REQUESTED_BY_ROUTER),
            parameters=BLS_PARAMETERS,
        )
        try:
            yield from self._replies(bls_stream(req, model))
        finally:
            self.cancels.clear(request_id)  # a mark, if any, has done its work

    @staticmethod
    def _replies(responses: Iterable[pb_utils.InferenceResponse]) -> Iterator[RoutedReply]:
        for response in responses:
            reply = OrchestratorReply.decode(
                output_arrays(response, OrchestratorReply.TENSORS.names)
            )
            if reply is not None:  # None: the acknowledgement, or the response carrying FINAL
                yield reply

    def cancel(self, request_id: str) -> None:
        self.cancels.mark(request_id)
