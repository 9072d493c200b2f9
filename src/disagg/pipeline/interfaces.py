"""What the orchestrator talks to: the two pools (local.py, triton/pools.py and remote/
implement them) and the hooks it reports through (the Triton model's metrics)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from disagg.contracts import DecodeStep, Handoff
from disagg.engine.sequence import SamplingParams
from disagg.pipeline.conditional import Load


class PrefillPool(Protocol):
    def prefill(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, skip_tokens: int = 0
    ) -> Handoff:
        """Its payload leaves out the first `skip_tokens` (decode holds them). Raises
        RequestError for a bad request, PoolError for anything else."""
        ...


class DecodePool(Protocol):
    def generate(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        handoff: Handoff | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[DecodeStep]:
        """Stream decode steps; without a handoff decode prefills `prompt_ids` itself; with
        one, `prompt_ids` name its K/V (decode keeps them in its prefix cache)."""
        ...

    def cancel(self, request_id: str) -> None: ...


class OrchestratorEvents:
    """Hooks for metrics (times in seconds, labels from small closed sets); the default does
    nothing. `served_by` is DISAGGREGATED, COLOCATED or FALLBACK."""

    def first_token(self, served_by: str, ttft_s: float) -> None: ...

    def token_gap(self, served_by: str, itl_s: float, num_tokens: int) -> None: ...

    def finished(self, served_by: str, finish_reason: str, e2e_s: float) -> None: ...

    def prefill(self, queue_s: float, compute_s: float) -> None: ...

    def kv_handoff(self, num_bytes: int, seconds: float, path: str) -> None: ...

    def kv_handoff_skipped(self, num_bytes: int) -> None:
        """Prompt K/V bytes a hand-off decode accepted left out (its prefix cache had them)."""

    def kv_prefix_miss(self) -> None:
        """Decode lacked the prefix a partial hand-off left out: it was handed off whole."""

    def decision(self, remote: bool, reason: str, estimates: Mapping[str, float]) -> None:
        """Where a prompt is prefilled, why, and the cost model's estimates it was decided
        with (pipeline/conditional.py: CostModel.estimates)."""

    def error(self, stage: str, kind: str) -> None: ...

    def load(self, load: Load) -> None: ...

    def cached_tokens(self, num_tokens: int) -> None:
        """A finished request's prompt tokens that a prefix cache gave."""
