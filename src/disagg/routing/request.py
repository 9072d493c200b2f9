"""A router request from the client's fields: its routing features, the local pipeline's
fields, and the chat request an OpenAI-compatible endpoint would get (when it can get one)."""

from __future__ import annotations

import json
from typing import Protocol

from disagg import contracts as P
from disagg.contracts import new_request_id
from disagg.errors import RequestError
from disagg.routing.endpoint import ChatRequest
from disagg.routing.policy import RouteFeatures
from disagg.routing.router import RouteRequest

# router-only inputs: hints for the policy, and the prompt forms the router turns into ids
ROUTER_ONLY = (
    P.MODEL,
    P.LATENCY_SLA_MS,
    P.TASK_TYPE,
    P.PRIORITY,
    P.MESSAGES,
    P.APPLY_CHAT_TEMPLATE,
)


class PromptEncoder(Protocol):
    def encode_prompt(self, text: str, messages_json: str, chat: bool) -> list[int]: ...


def _chat_messages(fields: dict) -> list[dict] | None:
    if fields.get(P.MESSAGES):
        return json.loads(fields[P.MESSAGES])  # already checked by encode_prompt
    if fields.get(P.APPLY_CHAT_TEMPLATE):
        return [{"role": "user", "content": fields.get(P.TEXT_INPUT, "")}]
    return None


def local_only_fields(fields: dict, messages: list[dict] | None) -> tuple[str, ...]:
    """Fields whose meaning an OpenAI chat endpoint cannot reproduce: such requests stay local
    rather than being answered differently from what was asked."""
    why = []
    if messages is None:
        why.append("raw_prompt")  # chat endpoints only take messages
    if fields.get(P.TOP_K, 0) > 0:
        why.append(P.TOP_K)
    if any(fields.get(P.BAD_WORDS, [])):
        why.append(P.BAD_WORDS)
    if P.END_ID in fields:
        why.append(P.END_ID)
    if fields.get(P.IGNORE_EOS):
        why.append(P.IGNORE_EOS)
    return tuple(why)


def build_route_request(
    fields: dict,
    tokenizer: PromptEncoder,
    default_model: str,
    max_tokens_default: int,
    client_request_id: str = "",
) -> RouteRequest:
    if not fields.get(P.TEXT_INPUT) and not fields.get(P.MESSAGES):
        raise RequestError(f"give {P.TEXT_INPUT} or {P.MESSAGES}")
    prompt_ids = tokenizer.encode_prompt(
        fields.get(P.TEXT_INPUT, ""),
        fields.get(P.MESSAGES, ""),
        bool(fields.get(P.APPLY_CHAT_TEMPLATE, False)),
    )
    max_tokens = int(fields.get(P.MAX_TOKENS, max_tokens_default))
    if max_tokens < 1:
        raise RequestError(f"{P.MAX_TOKENS} must be >= 1, got {max_tokens}")
    sla = fields.get(P.LATENCY_SLA_MS)
    if sla is not None and sla <= 0:
        raise RequestError(f"{P.LATENCY_SLA_MS} must be > 0, got {sla}")
    messages = _chat_messages(fields)
    features = RouteFeatures(
        model=fields.get(P.MODEL) or default_model,
        task_type=fields.get(P.TASK_TYPE, ""),
        latency_sla_ms=sla,
        priority=int(fields.get(P.PRIORITY, 0)),
        max_tokens=max_tokens,
        prompt_tokens=len(prompt_ids),
        messages=len(messages) if messages else 0,
    )
    local = {k: v for k, v in fields.items() if k not in ROUTER_ONLY}
    local[P.INPUT_IDS] = prompt_ids
    not_for_endpoints = local_only_fields(fields, messages)
    chat = None
    if not not_for_endpoints and messages is not None:
        chat = ChatRequest(
            messages=messages,
            max_tokens=max_tokens,
            temperature=float(fields.get(P.TEMPERATURE, 0.0)),
            top_p=float(fields.get(P.TOP_P, 1.0)),
            seed=fields.get(P.SEED),
            stop=tuple(s for s in fields.get(P.STOP_WORDS, []) if s),
        )
    return RouteRequest(
        request_id=new_request_id(client_request_id),
        features=features,
        local_fields=local,
        chat=chat,
        not_for_endpoints=not_for_endpoints,
        prompt_text=fields.get(P.TEXT_INPUT, ""),
        stream=bool(fields.get(P.STREAM, False)),
        exclude_input_in_output=bool(fields.get(P.EXCLUDE_INPUT_IN_OUTPUT, False)),
    )
