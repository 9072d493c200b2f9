"""Test double of `tensorrt_llm.llmapi` (see the package docstring): DisaggregatedParams and
GuidedDecodingParams (1.0: tensorrt_llm/sampling_params.py, re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    """Upstream's fields; like its _validate(), more than one guide is an error."""

    json: str | dict | None = None
    regex: str | None = None
    grammar: str | None = None  # EBNF
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        n = sum(
            x is not None for x in (self.json, self.regex, self.grammar, self.structural_tag)
        ) + int(self.json_object)
        if n > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {n}.")
