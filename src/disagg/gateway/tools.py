"""Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) for models whose chat
template has no tool section, as SmolLM2's has none: the Hermes format that vLLM's `hermes`
tool parser reads and Qwen 2.5's and NousResearch's Hermes templates write.

- The tools are described in the system message, inside `<tools></tools>`, one JSON
  function signature a line, with the instruction to answer a call as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- An assistant message's `tool_calls` become that text; a `tool` message becomes a
  `<tool_response>` in a user turn (as Qwen 2.5's template writes it; an OpenAI-compatible
  endpoint the router picks takes it as it is).
- The reply is parsed back: `<tool_call>` blocks whose JSON names a given tool become
  `tool_calls` (ids `call_...`, arguments as a JSON string) and `finish_reason: tool_calls`;
  the text before the first block is the message's content.
- `tool_choice` `required` or a named function constrains decoding (a Lark grammar with the
  functions' JSON schemas: engine/grammar.py), so the call always parses and its arguments
  validate; `auto` leaves the model free and parses what it wrote (a block that does not
  parse stays text); `none` describes no tools.

The format is a per-model choice, as vLLM's `--tool-call-parser` is per deployment: the
registry's `tool_format` for each public model names one of FORMATS (a ToolFormat; Hermes,
the default, is the one so far). A model that brings its own (Llama 3's, Qwen's) gets a
class beside Hermes and its name in the registry.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from disagg.engine.grammar import check_schema
from disagg.engine.sequence import MAX_GUIDE_CHARS
from disagg.errors import RequestError
from disagg.gateway.errors import bad_request

JSON = dict[str, Any]
MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolFormat(Protocol):
    """How one model family writes tools, calls and results into text, and reads calls back.
    A call is the text between OPEN and CLOSE; HEAD, where the format has one, matches an
    open block's beginning up to its arguments (its group 1: the name), so that a stream's
    arguments can go out as they are written (tool_stream.py); None: each call whole."""

    @property
    def name(self) -> str: ...
    @property
    def OPEN(self) -> str: ...  # noqa: N802 (the formats' constants)
    @property
    def CLOSE(self) -> str: ...  # noqa: N802
    @property
    def HEAD(self) -> re.Pattern[str] | None: ...  # noqa: N802

    def system_text(self, tools: Tools) -> str: ...

    def call_text(self, name: str, arguments: object) -> str: ...

    def tool_result_text(self, content: str) -> str: ...

    def grammar(self, tools: Tools) -> str: ...


@dataclass(frozen=True)
class Tools:
    """A request's tools, checked, and the format its model writes them in."""

    functions: tuple[JSON, ...]  # OpenAI's {"name", "description", "parameters"}
    choice: str = "auto"  # "auto" | "required" | "none" | "function"
    name: str = ""  # the named function, when choice is "function"
    parallel: bool = True
    fmt: ToolFormat = field(default_factory=lambda: FORMATS["hermes"])

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}


def parse_tools(body: JSON, fmt: ToolFormat | None = None) -> Tools | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> Tools in `fmt` (default Hermes; None:
    no tools to offer)."""
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise bad_request(f"'{old}' is deprecated by OpenAI: send 'tools'", old)
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' must be an array of at most {MAX_TOOLS} tools", "tools")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    if len({f["name"] for f in functions}) != len(functions):
        raise bad_request("'tools': function names must be unique", "tools")
    name = ""
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(named, str) or named not in {f["name"] for f in functions}:
            raise bad_request("'tool_choice' must name a function given in 'tools'", "tool_choice")
        choice, name = "function", named
    elif choice not in ("auto", "required", "none"):
        raise bad_request(
            "'tool_choice' must be none, auto, required or {'type': 'function', ...}",
            "tool_choice",
        )
    if choice == "none":
        return None
    _check_schemas(functions, strict=choice in ("required", "function"))
    return Tools(functions, choice, name, parallel, fmt or HERMES)


def _check_schemas(functions: tuple[JSON, ...], strict: bool) -> None:
    """Each function's parameters compile as a JSON schema: strictly when a call must come
    (its grammar is built from them), leniently under auto (unimplemented keywords ignored,
    a malformed schema still refused: such a call could never be validated)."""
    total = sum(len(json.dumps(f["parameters"])) for f in functions)
    if total > MAX_GUIDE_CHARS:
        raise bad_request(f"'tools': parameters over {MAX_GUIDE_CHARS} characters in all", "tools")
    for i, f in enumerate(functions):
        try:
            check_schema(f["parameters"], lenient=not strict)
        except RequestError as e:
            raise bad_request(f"tools[{i}].function.parameters: {e}", "tools") from e


def _function(i: int, tool: object) -> JSON:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if (
        not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or not NAME.match(fn["name"])
    ):
        raise bad_request(
            f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a "
            "name of 1-64 letters, digits, '_', '.' or '-'",
            "tools",
        )
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    if len(json.dumps(params)) > MAX_GUIDE_CHARS:
        raise bad_request(
            f"tools[{i}].function.parameters is over {MAX_GUIDE_CHARS} characters", "tools"
        )
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise bad_request(f"tools[{i}].function.description must be a string", "tools")
    out: JSON = {"name": fn["name"], "description": description, "parameters": params}
    return out


# ------------------------------------------------------------------ the Hermes format


class Hermes:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    HEAD: re.Pattern[str] | None = re.compile(
        r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*(?=\{)'
    )

    @staticmethod
    def system_text(tools: Tools) -> str:
        lines = "\n".join(json.dumps({"type": "function", "function": f}) for f in tools.functions)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    @classmethod
    def call_text(cls, name: str, arguments: object) -> str:
        return f"{cls.OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{cls.CLOSE}"

    @staticmethod
    def tool_result_text(content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    @classmethod
    def grammar(cls, tools: Tools) -> str:
        """A Lark grammar that admits only well-formed calls of the allowed functions."""
        allowed = [
            f for f in tools.functions if tools.choice != "function" or f["name"] == tools.name
        ]
        schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in allowed
            ],
            "x-guidance": COMPACT,
        }
        call = f'"{cls.OPEN}\\n" %json {json.dumps(schema)} "\\n{cls.CLOSE}"'
        repeat = tools.parallel and tools.choice != "function"
        return f'start: call ("\\n" call)*\ncall: {call}' if repeat else f"start: {call}"


HERMES = Hermes()
FORMATS: dict[str, ToolFormat] = {Hermes.name: HERMES}


# ------------------------------------------------------------------ messages in


def render_messages(
    messages: list[JSON], tools: Tools | None, fmt: ToolFormat | None = None
) -> list[dict[str, str]]:
    """OpenAI chat messages (tool calls and tool results included) -> plain ones for the chat
    template, in `fmt` (the tools', else Hermes), with the tools described in the system
    message."""
    form = fmt or (tools.fmt if tools is not None else HERMES)
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content")
        text = _text(i, content)
        if role == "assistant" and m.get("tool_calls"):
            calls = [_call_text(i, c, form) for c in _list(i, m["tool_calls"])]
            text = "\n".join([text, *calls] if text else calls)
        elif role == "tool":  # a user turn, as Qwen 2.5's template writes it: any chat
            role, text = "user", form.tool_result_text(text)  # endpoint takes it
        out.append({"role": role, "content": text})
    if tools is not None:
        described = form.system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _text(i: int, content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise bad_request(f"messages[{i}].content: text parts only", f"messages[{i}].content")
        return "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string", "messages")
    return content


def _list(i: int, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise bad_request(f"messages[{i}].tool_calls must be an array", "messages")
    return value


def _call_text(i: int, call: object, fmt: ToolFormat) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls: each needs function.name", "messages")
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError as e:
        raise bad_request(
            f"messages[{i}].tool_calls: function.arguments is not JSON: {e}", "messages"
        ) from e
    return fmt.call_text(fn["name"], parsed)


# ------------------------------------------------------------------ replies out


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_json(self, index: int | None = None) -> JSON:
        out: JSON = {"id": self.id, "type": "function"}
        if index is not None:
            out = {"index": index, **out}
        out["function"] = {"name": self.name, "arguments": self.arguments}
        return out


def parse_reply(text: str, tools: Tools) -> tuple[str | None, list[ToolCall]]:
    """(content, calls). Blocks that do not parse, or name no given tool, leave the whole
    reply as text (never a call the client would choke on)."""
    fmt = tools.fmt
    start = text.find(fmt.OPEN)
    if start < 0:
        return text, []
    calls, at = [], start
    while (at := text.find(fmt.OPEN, at)) >= 0:
        end = block_end(text, at + len(fmt.OPEN), fmt)
        call = None if end is None else parse_call(text[at + len(fmt.OPEN) : end], tools)
        if call is None:
            return text, []
        calls.append(call)
        at = end + len(fmt.CLOSE)  # type: ignore[operator]  # (end is set: call is not None)
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def block_end(text: str, start: int, fmt: ToolFormat) -> int | None:
    """Where the block whose body begins at `start` closes: the first CLOSE whose body before
    it is a whole JSON value (a CLOSE inside one of its strings is text, as a grammar's %json
    admits it); None while no CLOSE does."""
    at = start
    while (at := text.find(fmt.CLOSE, at)) >= 0:
        try:
            json.loads(text[start:at])
            return at
        except ValueError:
            at += 1
    return None


def parse_call(block: str, tools: Tools) -> ToolCall | None:
    """A block's call, its arguments as the model wrote them (so a stream's argument
    deltas, sent as they came, add up to the same string)."""
    try:
        obj = json.loads(block)
        spans = _value_spans(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tools.names:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    raw = block[slice(*spans["arguments"])] if "arguments" in spans else "{}"
    return ToolCall(obj["name"], raw)


def _value_spans(text: str) -> dict[str, tuple[int, int]]:
    """Where each top-level value of a JSON object stands in `text` (ValueError if it is
    not one object)."""
    decoder, ws = json.JSONDecoder(), re.compile(r"\s*")
    i = ws.match(text, 0).end()  # type: ignore[union-attr]
    if text[i : i + 1] != "{":
        raise ValueError("not an object")
    spans: dict[str, tuple[int, int]] = {}
    i = ws.match(text, i + 1).end()  # type: ignore[union-attr]
    while text[i : i + 1] != "}":
        key, i = decoder.raw_decode(text, i)
        i = ws.match(text, i).end()  # type: ignore[union-attr]
        if text[i : i + 1] != ":":
            raise ValueError("expected ':'")
        start = ws.match(text, i + 1).end()  # type: ignore[union-attr]
        _, i = decoder.raw_decode(text, start)
        spans[str(key)] = (start, i)
        i = ws.match(text, i).end()  # type: ignore[union-attr]
        if text[i : i + 1] == ",":
            i = ws.match(text, i + 1).end()  # type: ignore[union-attr]
    return spans
