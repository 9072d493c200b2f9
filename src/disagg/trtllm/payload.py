"""The TensorRT-LLM hand-off as bytes: what travels in the orchestrator's `kv_payload`.

    b"DGTRT1" + JSON {"prompt_ids": [...], "seed": int, "params": {field: value},
                      "cache_salt": str (only when the context request had one)}

`params` holds every field of TensorRT-LLM's DisaggregatedParams as it was returned by the
context request (bytes fields such as `opaque_state` as {"b64": ...}), so fields added in
later TensorRT-LLM versions travel too.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from disagg.errors import KVPayloadError

MAGIC = b"DGTRT1"


@dataclass(frozen=True)
class TrtllmHandoff:
    prompt_ids: list[int]
    seed: int
    params: dict[str, Any]  # DisaggregatedParams fields, as the library returned them
    # the context request's cache_salt: the generation half hashes the same blocks the same way
    cache_salt: str = ""


def params_to_dict(params: object) -> dict[str, Any]:
    if dataclasses.is_dataclass(params):
        raw = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    else:
        raw = dict(vars(params))
    return {k: v for k, v in raw.items() if v is not None}


def _encode(value: object) -> object:
    if isinstance(value, bytes | bytearray):
        return {"b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    return value


def _decode(value: object) -> object:
    if isinstance(value, dict) and set(value) == {"b64"}:
        return base64.b64decode(value["b64"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def to_bytes(h: TrtllmHandoff) -> bytes:
    params = {k: _encode(v) for k, v in h.params.items()}
    body: dict[str, Any] = {"prompt_ids": h.prompt_ids, "seed": h.seed, "params": params}
    if h.cache_salt:
        body["cache_salt"] = h.cache_salt
    return MAGIC + json.dumps(body, separators=(",", ":")).encode()


def is_trtllm_payload(data: bytes | memoryview) -> bool:
    return bytes(data[: len(MAGIC)]) == MAGIC


def from_bytes(data: bytes | memoryview) -> TrtllmHandoff:
    data = bytes(data)
    if not is_trtllm_payload(data):
        raise KVPayloadError("not a TensorRT-LLM hand-off (a KV payload of the PyTorch engine?)")
    try:
        body = json.loads(data[len(MAGIC) :])
        return TrtllmHandoff(
            prompt_ids=[int(t) for t in body["prompt_ids"]],
            seed=int(body["seed"]),
            params={k: _decode(v) for k, v in body["params"].items()},
            cache_salt=str(body.get("cache_salt", "")),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise KVPayloadError(f"damaged TensorRT-LLM hand-off: {e}") from e
