"""OpenAI's streamed tool-call deltas, merged into whole calls: the router (an endpoint's
reply collected whole) and the gateway (a relayed stream collected whole) both need it."""

from __future__ import annotations

from typing import Any


def merge_tool_calls(calls: dict[int, dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Add OpenAI tool-call deltas to the calls they belong to (by index): the id, type and
    name as they first come, the arguments concatenated."""
    for d in deltas:
        call = calls.setdefault(
            d["index"], {"index": d["index"], "id": "", "type": "function",
                         "function": {"name": "", "arguments": ""}}
        )  # fmt: skip
        call["id"] = call["id"] or d.get("id") or ""
        fn = d.get("function") or {}
        call["function"]["name"] = call["function"]["name"] or fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""


def merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The whole calls that `deltas` make, by index."""
    calls: dict[int, dict[str, Any]] = {}
    merge_tool_calls(calls, deltas)
    return [calls[i] for i in sorted(calls)]
