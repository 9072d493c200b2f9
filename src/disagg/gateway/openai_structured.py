"""Structured outputs in an OpenAI body -> the guided-decoding inputs (engine/grammar.py).

OpenAI's `response_format` (`json_object`, `json_schema` with `strict`: disagg always
enforces the schema), and for chat and completions alike vLLM's `structured_outputs`
({"json": schema, "regex": str, "grammar": GBNF/Lark, "choice": [str], "json_object":
true}: exactly one) and its older spellings `guided_json`, `guided_regex`, `guided_grammar`,
`guided_choice`. Shapes and grammar syntax are checked here, a 400 naming the field; whether
a guide compiles against the model's vocabulary is the orchestrator's (also a 400, with the
library's reason).
"""

from __future__ import annotations

import json
from typing import Any

from disagg import contracts as C
from disagg.engine.grammar import check_syntax
from disagg.engine.sequence import MAX_GUIDE_CHARS
from disagg.errors import RequestError
from disagg.gateway.errors import bad_request

JSON = dict[str, Any]
MAX_CHOICES = 256
_VLLM_KEYS = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar",
              "choice": "guided_choice"}  # fmt: skip


def structured_output(body: JSON, inputs: dict[str, object]) -> None:
    """Set GUIDED_DECODING_GUIDE_TYPE / _GUIDE from whichever field asks for structure."""
    guides = [g for g in (_response_format(body), *_vllm(body)) if g is not None]
    if len(guides) > 1:
        raise bad_request(
            "give one of response_format, structured_outputs and guided_*, not several",
            "response_format",
        )
    if guides:
        (guide_type, guide, field) = guides[0]
        if len(guide) > MAX_GUIDE_CHARS:
            raise bad_request(f"'{field}' is over {MAX_GUIDE_CHARS} characters", field)
        try:
            check_syntax(guide_type, guide)
        except RequestError as e:
            raise bad_request(f"'{field}': {e}", field) from e
        inputs[C.GUIDED_DECODING_GUIDE_TYPE] = guide_type
        if guide:
            inputs[C.GUIDED_DECODING_GUIDE] = guide


def _response_format(body: JSON) -> tuple[str, str, str] | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json", "", "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad_request(
                "'response_format.json_schema' must be an object with a 'schema' object",
                "response_format",
            )
        if not isinstance(spec.get("name", ""), str) or not isinstance(
            spec.get("strict", False), bool | None
        ):
            raise bad_request(
                "'response_format.json_schema': 'name' is a string, 'strict' a boolean",
                "response_format",
            )
        schema = spec.get("schema", {})  # OpenAI: absent means any JSON object
        return ("json_schema", json.dumps(schema or {"type": "object"}), "response_format")
    raise bad_request(
        "'response_format.type' must be text, json_object or json_schema", "response_format"
    )


def _vllm(body: JSON) -> list[tuple[str, str, str] | None]:
    out: list[tuple[str, str, str] | None] = []
    spec = body.get("structured_outputs")
    if spec is not None:
        if not isinstance(spec, dict):
            raise bad_request("'structured_outputs' must be an object", "structured_outputs")
        given = {k: v for k, v in spec.items() if v not in (None, False)}
        unknown = set(given) - {*_VLLM_KEYS, "json_object"}
        if unknown or len(given) != 1:
            raise bad_request(
                "'structured_outputs' takes exactly one of json, regex, grammar, choice, "
                "json_object",
                "structured_outputs",
            )
        ((key, value),) = given.items()
        out.append(_one(key, value, "structured_outputs"))
    for key, old in _VLLM_KEYS.items():
        if body.get(old) is not None:
            out.append(_one(key, body[old], old))
    return out


def _one(key: str, value: object, field: str) -> tuple[str, str, str]:
    if key == "json_object":
        return ("json", "", field)
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad_request(f"'{field}': the JSON schema is not JSON: {e}", field) from e
        if not isinstance(value, dict):
            raise bad_request(f"'{field}': a JSON schema is an object", field)
        return ("json_schema", json.dumps(value), field)
    if key in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise bad_request(f"'{field}': the {key} must be a non-empty string", field)
        return ("regex" if key == "regex" else "ebnf_grammar", value, field)
    # choice: one of these strings, exactly (a Lark grammar of JSON-quoted literals)
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_CHOICES
        or not all(isinstance(c, str) and c for c in value)
    ):
        raise bad_request(f"'{field}': choice must be 1 to {MAX_CHOICES} non-empty strings", field)
    return ("lark", "start: " + " | ".join(json.dumps(c) for c in value), field)
