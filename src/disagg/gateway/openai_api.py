"""OpenAI request bodies -> the router's inputs, and the router's outputs -> OpenAI responses.

Fields disagg cannot honour are refused with a 400 naming them, never silently ignored:
the deprecated functions, and for completions `echo`, `best_of` > 1, `suffix` and several
prompts. Logprobs come from the model's raw distribution (engine/sequence.py TokenLogprob),
at most MAX_LOGPROBS alternatives per token. Sampling controls beyond OpenAI's (vLLM's
extensions): `repetition_penalty`, `min_tokens`, `stop_token_ids`; structured outputs:
openai_structured.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from disagg import contracts as C
from disagg.engine.sequence import FinishReason
from disagg.gateway.errors import bad_request, unsupported
from disagg.gateway.openai_sampling import (
    logprobs_fields,
    max_tokens_of,
    number,
    sampling_controls,
)
from disagg.gateway.openai_structured import structured_output
from disagg.gateway.tools import (
    HERMES,
    ToolFormat,
    Tools,
    parse_reply,
    parse_tools,
    render_messages,
)

MAX_STOP = 4
MAX_N = 16  # choices per request (OpenAI allows 128; each is a sequence in the decode batch)
INT32_MAX = 2**31 - 1
JSON = dict[str, Any]  # a JSON object, as the client sent it or as we answer


@dataclass
class GenRequest:
    """One validated request, in the router's terms."""

    kind: str  # "chat" | "completion"
    model: str
    inputs: dict[str, object]  # router inputs (tensor name -> value)
    stream: bool = False
    include_usage: bool = False
    tools: Tools | None = None  # offered to the model: its reply is parsed for calls
    n: int = 1  # choices (gateway/choices.py)
    logprobs: bool = False  # each choice carries its tokens' logprobs
    created: int = field(default_factory=lambda: int(time.time()))


MAX_CACHE_SALT = 128  # the gateway prefixes the API key's id (SamplingParams allows 256)


def _prefix_cache(body: JSON, inputs: dict[str, object]) -> None:
    """vLLM's `cache_salt` (a namespace within the caller's own; the gateway puts every key
    in a namespace of its own, so a salt can only narrow sharing) and disagg's
    `use_prefix_cache` (false: this request neither reads nor leaves cached K/V)."""
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT:
            raise bad_request(
                f"'cache_salt' must be a string of at most {MAX_CACHE_SALT} characters",
                "cache_salt",
            )
        inputs[C.CACHE_SALT] = salt
    use = body.get("use_prefix_cache", True)
    if not isinstance(use, bool):
        raise bad_request("'use_prefix_cache' must be a boolean", "use_prefix_cache")
    if not use:
        inputs[C.USE_PREFIX_CACHE] = False


def key_salt(key_id: str, inputs: dict[str, object]) -> None:
    """Put the request in its API key's prefix-cache namespace: one key's cached prompt
    never shortens another key's prefill, so its timing tells nothing about other keys."""
    inputs[C.CACHE_SALT] = f"key:{key_id}|{inputs.get(C.CACHE_SALT, '')}"


def _hints(body: JSON, inputs: dict[str, object]) -> None:
    """disagg's routing hints (extensions to OpenAI's body), checked as strictly as the rest:
    the router's tensors are FP32 / INT32 / one string."""
    sla = number(body, "latency_sla_ms", 0, 1e9)
    if sla is not None:
        inputs[C.LATENCY_SLA_MS] = float(sla)
    priority = number(body, "priority", -INT32_MAX, INT32_MAX, integer=True)
    if priority is not None:
        inputs[C.PRIORITY] = priority
    task_type = body.get("task_type")
    if task_type is not None:
        if not isinstance(task_type, str) or len(task_type) > 128:
            raise bad_request("'task_type' must be a string of at most 128 characters", "task_type")
        inputs[C.TASK_TYPE] = task_type


def _refuse_unsupported(body: JSON, kind: str) -> None:
    if kind == "completion":
        if body.get("echo"):
            raise unsupported("echo")
        if body.get("best_of", 1) != 1:
            raise unsupported("best_of")
        if body.get("suffix"):
            raise unsupported("suffix")


def _messages(body: JSON, tools: Tools | None, fmt: ToolFormat) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(
                f"messages[{i}].role must be system, developer, user, assistant or tool",
                "messages",
            )
        if m.get("content") is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise bad_request(f"messages[{i}].content must be a string", "messages")
    plain = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
    return render_messages(plain, tools, fmt)


ROLES = ("system", "developer", "user", "assistant", "tool")


def _prompt(body: JSON) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise unsupported("prompt", "one string prompt per request")
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("'prompt' must be a non-empty string", "prompt")
    return prompt


def parse_request(
    body: object, kind: str, max_n: int = MAX_N, tool_format: ToolFormat = HERMES
) -> GenRequest:
    """`max_n`: the choices decode can run together (GatewayConfig.max_n); `tool_format`:
    how the model writes tools (the registry's tool_format for it)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required", "model")
    _refuse_unsupported(body, kind)
    inputs: dict[str, object] = {C.EXCLUDE_INPUT_IN_OUTPUT: True}
    tools = None
    if kind == "chat":
        tools = parse_tools(body, tool_format)
        inputs[C.MESSAGES] = json.dumps(_messages(body, tools, tool_format))
        if tools is not None:  # an OpenAI endpoint serves them natively (docs/routing.md)
            native = {k: body.get(k) for k in ("messages", "tools", "tool_choice",
                                               "parallel_tool_calls")}  # fmt: skip
            inputs[C.OPENAI_TOOLS] = json.dumps(native)
    else:
        inputs[C.TEXT_INPUT] = _prompt(body)
    max_tokens = max_tokens_of(body)
    if max_tokens is not None:
        inputs[C.MAX_TOKENS] = max_tokens
    for name, lo, hi in ((C.TEMPERATURE, 0.0, 2.0), (C.TOP_P, 0.0, 1.0)):
        value = number(body, name, lo, hi)  # OpenAI's names and the tensors' agree
        if value is not None:
            inputs[name] = float(value)
    seed = number(body, "seed", 0, 2**63 - 1, integer=True)
    if seed is not None:
        inputs[C.SEED] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request("'stop' must be a string or an array of strings", "stop")
        if len(stops) > MAX_STOP:
            raise bad_request(f"'stop' takes at most {MAX_STOP} sequences", "stop")
        if any(stops):
            inputs[C.STOP_WORDS] = [s for s in stops if s]
    sampling_controls(body, inputs)
    structured_output(body, inputs)
    if tools is not None:
        _tool_inputs(tools, inputs)
    _hints(body, inputs)
    ignore_eos = body.get("ignore_eos", False)  # vLLM's extension: exactly max_tokens tokens
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be a boolean", "ignore_eos")
    if ignore_eos:
        inputs[C.IGNORE_EOS] = True
    _prefix_cache(body, inputs)
    logprobs = logprobs_fields(body, kind, inputs)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    if options and not stream:  # (as OpenAI answers)
        raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
    return GenRequest(
        kind=kind,
        model=model,
        inputs=inputs,
        stream=stream,
        include_usage=include_usage,
        tools=tools,
        n=_choices(body, max_n),
        logprobs=logprobs,
    )


def _choices(body: JSON, max_n: int) -> int:
    """`n`: each choice is a sequence of its own in the decode batch, holding its own KV
    (prompt + max_tokens); choices beyond the sequences decode runs at once could not decode
    together (the later ones would wait for the first to end), so they are refused. This is
    also the KV budget's rule: a decode instance holds decode_max_num_seqs x max_model_len
    positions (EngineConfig.num_kv_blocks), and each choice's prompt + max_tokens is within
    max_model_len (checked per choice by the orchestrator), so n choices that pass here fit."""
    n = int(number(body, "n", 1, MAX_N, integer=True) or 1)
    if n > max_n:
        raise bad_request(
            f"'n' = {n}: this server decodes {max_n} sequences at once (decode_max_num_seqs), "
            "and each choice is one of them with its own KV cache; ask for fewer",
            "n",
        )
    return n


def _tool_inputs(tools: Tools, inputs: dict[str, object]) -> None:
    """A call that must come is decoded under a grammar of the allowed calls; the request
    is of the "tool_call" task class unless the client named one (routing rules match it)."""
    if tools.choice in ("required", "function"):
        if C.GUIDED_DECODING_GUIDE_TYPE in inputs:
            raise bad_request(
                "'tool_choice' required or a named function cannot be combined with "
                "response_format or structured_outputs",
                "tool_choice",
            )
        inputs[C.GUIDED_DECODING_GUIDE_TYPE] = "lark"
        inputs[C.GUIDED_DECODING_GUIDE] = tools.fmt.grammar(tools)
    inputs.setdefault(C.TASK_TYPE, TOOL_TASK)


TOOL_TASK = "tool_call"


# ------------------------------------------------------------------ responses

# disagg's finish reasons -> OpenAI's (a cancelled request ends as "stop")
FINISH: dict[str, str] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "stop",
}
TOOL_CALLS = "tool_calls"  # OpenAI's finish reason for a reply that is calls


def _envelope(
    req: GenRequest, rid: str, fingerprint: str, obj: str, prefix: str, choice: JSON
) -> JSON:
    return {
        "id": prefix + rid,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "system_fingerprint": fingerprint,
        "choices": [choice],
    }


def usage(n_in: int, n_out: int, n_cached: int = 0) -> JSON:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens a prefix cache gave
    (as OpenAI and vLLM report them)."""
    return {
        "prompt_tokens": n_in,
        "completion_tokens": n_out,
        "total_tokens": n_in + n_out,
        "prompt_tokens_details": {"cached_tokens": n_cached},
    }


def choice_logprobs(req: GenRequest, content: list[JSON], offset: int = 0) -> JSON:
    """A choice's logprobs in its API's shape: chat's `content` objects as they come from the
    orchestrator; completions' parallel lists, `text_offset` counting from `offset` (the
    characters of the choice's text before these tokens)."""
    if req.kind == "chat":
        return {"content": content, "refusal": None}
    offsets = []
    for t in content:
        offsets.append(offset)
        offset += len(t["token"])
    return {
        "tokens": [t["token"] for t in content],
        "token_logprobs": [t["logprob"] for t in content],
        "top_logprobs": [{a["token"]: a["logprob"] for a in t["top_logprobs"]} for t in content],
        "text_offset": offsets,
    }


def whole_choice(
    req: GenRequest,
    text: str,
    finish: str,
    logprobs: list[JSON] | None = None,
    index: int = 0,
    relayed: list[JSON] | None = None,
) -> JSON:
    """One whole choice: its message (tool calls parsed out of it, or `relayed`: the calls an
    endpoint answered with) or text, its logprobs and its finish reason."""
    reason = FINISH.get(finish, finish)
    lp = choice_logprobs(req, logprobs or []) if req.logprobs else None
    if req.kind != "chat":
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
    message: JSON = {"role": "assistant", "content": text}
    if relayed:
        calls_json = [{k: v for k, v in c.items() if k != "index"} for c in relayed]
        message = {"role": "assistant", "content": text or None, "tool_calls": calls_json}
        reason = TOOL_CALLS if reason in ("stop", TOOL_CALLS) else reason  # (length stays)
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}
    if req.tools is not None:
        content, calls = parse_reply(text, req.tools)
        if calls:
            message = {"role": "assistant", "content": content}
            message["tool_calls"] = [c.as_json() for c in calls]
            reason = TOOL_CALLS if reason == "stop" else reason
    return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}


def whole_body(req: GenRequest, rid: str, fingerprint: str, choices: list[JSON], use: JSON) -> JSON:
    obj, prefix = (
        ("chat.completion", "chatcmpl-") if req.kind == "chat" else ("text_completion", "cmpl-")
    )
    envelope = _envelope(req, rid, fingerprint, obj, prefix, choices[0])
    return {**envelope, "choices": choices, "usage": use}


def full_response(
    req: GenRequest,
    rid: str,
    text: str,
    finish: str,
    n_in: int,
    n_out: int,
    fingerprint: str,
    n_cached: int = 0,
    logprobs: list[JSON] | None = None,
) -> JSON:
    one = whole_choice(req, text, finish, logprobs)
    return whole_body(req, rid, fingerprint, [one], usage(n_in, n_out, n_cached))


def chunk(
    req: GenRequest,
    rid: str,
    fingerprint: str,
    text: str | None = None,
    finish: str | None = None,
    role: bool = False,
    tool_calls: list[JSON] | None = None,
    logprobs: JSON | None = None,
) -> JSON:
    """One stream chunk of choice 0; `logprobs` in choice_logprobs' shape."""
    choice: JSON
    if req.kind == "chat":
        delta: JSON = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj, prefix = "chat.completion.chunk", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj, prefix = "text_completion", "cmpl-"
    if finish is not None:
        choice["finish_reason"] = FINISH.get(finish, finish) if finish != TOOL_CALLS else finish
    out = _envelope(req, rid, fingerprint, obj, prefix, choice)
    if req.include_usage:  # OpenAI: every chunk has "usage", null but on the last
        out["usage"] = None
    return out


def usage_chunk(
    req: GenRequest, rid: str, fingerprint: str, n_in: int, n_out: int, n_cached: int = 0
) -> JSON:
    c = chunk(req, rid, fingerprint)
    c["choices"] = []
    c["usage"] = usage(n_in, n_out, n_cached)
    return c


def sse(obj: str | JSON) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
