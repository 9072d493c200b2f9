"""A router request from the client's fields: its routing features, the local pipeline's
fields, and the chat request an OpenAI-compatible endpoint would get (when it can get one)."""

from __future__ import annotations

import json
from typing import Any, Protocol

from disagg import contracts as C
from disagg.codec.fields import GenerationFields
from disagg.codec.generate import OrchestratorRequest
from disagg.contracts import new_request_id
from disagg.errors import RequestError
from disagg.routing.endpoint import ChatRequest
from disagg.routing.policy import RouteFeatures
from disagg.routing.router import RouteRequest


class PromptEncoder(Protocol):
    def encode_prompt(self, text: str, messages_json: str, chat: bool) -> list[int]: ...


def _chat_messages(fields: dict[str, Any]) -> list[dict[str, Any]] | None:
    if fields.get(C.MESSAGES):
        messages: list[dict[str, Any]] = json.loads(fields[C.MESSAGES])  # checked: encode_prompt
        return messages
    if fields.get(C.APPLY_CHAT_TEMPLATE):
        return [{"role": "user", "content": fields.get(C.TEXT_INPUT, "")}]
    return None


def local_only_fields(
    fields: dict[str, Any], messages: list[dict[str, Any]] | None
) -> tuple[str, ...]:
    """Fields whose meaning an OpenAI chat endpoint cannot reproduce: such requests stay local
    rather than being answered differently from what was asked."""
    g = GenerationFields.parse(fields)
    why = []
    if messages is None:
        why.append("raw_prompt")  # chat endpoints only take messages
    if g.top_k > 0:
        why.append(C.TOP_K)
    if g.bad_words:
        why.append(C.BAD_WORDS)
    if g.end_id is not None:
        why.append(C.END_ID)
    if g.ignore_eos:
        why.append(C.IGNORE_EOS)
    # token ids are this model's; the endpoint's chat request carries no penalties (yet)
    for name, value, off in (
        (C.STOP_TOKEN_IDS, g.stop_token_ids, ()),
        (C.LOGIT_BIAS, g.logit_bias, ()),
        (C.MIN_LENGTH, g.min_length, 0),
        (C.PRESENCE_PENALTY, g.presence_penalty, 0.0),
        (C.FREQUENCY_PENALTY, g.frequency_penalty, 0.0),
        (C.REPETITION_PENALTY, g.repetition_penalty, 1.0),
    ):
        if value != off:
            why.append(name)
    # an OpenAI endpoint takes JSON (response_format) but not a regex or a grammar; with the
    # client's tools, a grammar is the gateway's for required calls, which the endpoint's
    # tool_choice does natively
    tool_grammar = g.guide_type == "lark" and bool(fields.get(C.OPENAI_TOOLS))
    if g.guide_type not in ("", "json", "json_schema") and not tool_grammar:
        why.append(C.GUIDED_DECODING_GUIDE_TYPE)
    if g.return_log_probs:  # Groq's API returns no logprobs (and the ids would be its own)
        why.append(C.RETURN_LOG_PROBS)
    return tuple(why)


def openai_tools(fields: dict[str, Any]) -> dict[str, Any] | None:
    """OPENAI_TOOLS: the client's messages and tools as it sent them (the gateway's JSON)."""
    text = fields.get(C.OPENAI_TOOLS)
    if not text:
        return None
    try:
        tools = json.loads(text)
    except ValueError as e:
        raise RequestError(f"{C.OPENAI_TOOLS} is not JSON: {e}") from e
    if not isinstance(tools, dict) or not isinstance(tools.get("messages"), list):
        raise RequestError(f"{C.OPENAI_TOOLS} must be an object with the client's messages")
    return tools


def response_format(g: GenerationFields) -> dict[str, Any] | None:
    """A JSON guide as OpenAI's response_format (what the endpoint gets)."""
    if g.guide_type == "json":
        return {"type": "json_object"}
    if g.guide_type == "json_schema":
        try:
            schema = json.loads(g.guide)
        except ValueError as e:
            raise RequestError(f"{C.GUIDED_DECODING_GUIDE} is not JSON: {e}") from e
        return {
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": schema, "strict": True},
        }
    return None


def build_route_request(
    fields: dict[str, Any],
    tokenizer: PromptEncoder,
    default_model: str,
    max_tokens_default: int,
    client_request_id: str = "",
) -> RouteRequest:
    if not fields.get(C.TEXT_INPUT) and not fields.get(C.MESSAGES):
        raise RequestError(f"give {C.TEXT_INPUT} or {C.MESSAGES}")
    g = GenerationFields.parse(fields)
    prompt_ids = tokenizer.encode_prompt(
        g.text_input, fields.get(C.MESSAGES, ""), bool(fields.get(C.APPLY_CHAT_TEMPLATE, False))
    )
    max_tokens = max_tokens_default if g.max_tokens is None else g.max_tokens
    if max_tokens < 1:
        raise RequestError(f"{C.MAX_TOKENS} must be >= 1, got {max_tokens}")
    sla = fields.get(C.LATENCY_SLA_MS)
    if sla is not None and sla <= 0:
        raise RequestError(f"{C.LATENCY_SLA_MS} must be > 0, got {sla}")
    messages = _chat_messages(fields)
    features = RouteFeatures(
        model=fields.get(C.MODEL) or default_model,
        task_type=fields.get(C.TASK_TYPE, ""),
        latency_sla_ms=sla,
        priority=int(fields.get(C.PRIORITY, 0)),
        max_tokens=max_tokens,
        prompt_tokens=len(prompt_ids),
        messages=len(messages) if messages else 0,
    )
    # what the local pipeline takes: the prompt's ids and the client's generation inputs as
    # it sent them (the orchestrator reads them with the same GenerationFields)
    local = {k: v for k, v in fields.items() if k in OrchestratorRequest.TENSORS.names}
    local[C.INPUT_IDS] = prompt_ids
    not_for_endpoints = local_only_fields(fields, messages)
    chat = None
    tools = openai_tools(fields)
    if not not_for_endpoints and messages is not None:
        chat = ChatRequest(
            messages=tools.pop("messages") if tools else messages,
            tools=tools,
            max_tokens=max_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            seed=g.seed,
            stop=g.stop_words,
            response_format=response_format(g),
        )
    return RouteRequest(
        request_id=new_request_id(client_request_id),
        features=features,
        local_fields=local,
        chat=chat,
        not_for_endpoints=not_for_endpoints,
        prompt_text=g.text_input,
        stream=g.stream,
        exclude_input_in_output=g.exclude_input_in_output,
    )
