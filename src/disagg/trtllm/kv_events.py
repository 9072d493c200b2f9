"""TensorRT-LLM's KV block reuse (prefix caching), seen from disagg: the pools' KV cache events
for a router to follow, and how many prompt tokens a request found cached.

Events: `LLM.get_kv_cache_events(timeout)` returns a list of dicts
(tensorrt_llm/_utils.py KVCacheEventSerializer), kept only when the pool's
`kv_cache_config` has `enable_block_reuse` and `event_buffer_max_size > 0`
(build_engines/build_trtllm_engine.py writes both):

    {"event_id": 7, "window_size": 4096,
     "data": {"type": "stored", "parent_hash": 12 | None,
              "blocks": [{"type": "stored_block", "block_hash": 34, "tokens": [...], ...}]}}
    {"event_id": 8, "data": {"type": "removed", "block_hashes": [34, ...]}}

("created" and "updated" events say nothing about which prefixes are cached: skipped.)

Cached tokens: TensorRT-LLM 1.0's RequestOutput / CompletionOutput carry no cached-token
count. A request that asks for `return_perf_metrics` (a SamplingParams field, set only where
the installed version declares it) gets `request_perf_metrics.kv_cache_metrics
.num_reused_blocks`, whole blocks of `tokens_per_block` tokens; later releases may add
`cached_tokens` to RequestOutput, which is read first when present."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

TOKENS_PER_BLOCK = 32  # TensorRT-LLM's default KV block (tokens_per_block) in 1.0


@dataclass(frozen=True)
class KvCacheEvent:
    """One change to the reusable KV blocks of a pool, in the order TensorRT-LLM made them."""

    event_id: int
    kind: str  # "stored": the blocks became reusable; "removed": evicted
    block_hashes: tuple[int, ...]  # stored: a chain, each block following the one before
    parent_hash: int | None = None  # stored: the block the chain follows (None: a prefix start)


def parse_events(raw: list[dict[str, Any]]) -> list[KvCacheEvent]:
    events = []
    for event in raw:
        data = event.get("data") or {}
        kind = data.get("type")
        if kind == "stored":
            hashes = tuple(int(b["block_hash"]) for b in data.get("blocks", []))
            parent = data.get("parent_hash")
            events.append(
                KvCacheEvent(
                    int(event["event_id"]),
                    "stored",
                    hashes,
                    None if parent is None else int(parent),
                )
            )
        elif kind == "removed":
            hashes = tuple(int(h) for h in data.get("block_hashes", []))
            events.append(KvCacheEvent(int(event["event_id"]), "removed", hashes))
    return events


def read_events(llm: Any, timeout_s: float) -> list[KvCacheEvent]:
    """What the pool's KV cache did since the last call (waits up to timeout_s for some)."""
    return parse_events(list(llm.get_kv_cache_events(timeout=timeout_s) or []))


@dataclass(frozen=True)
class RequestFeatures:
    """What the installed LLM API takes per request, found once by inspection (a field that
    1.0 lacks would fail every request)."""

    perf_metrics: bool  # SamplingParams(return_perf_metrics=...)
    cache_salt: bool  # generate / generate_async(cache_salt=...)
    tokens_per_block: int = TOKENS_PER_BLOCK
    guided_backend: str | None = None  # the LLM's guided_decoding_backend, if it has one

    @classmethod
    def of(cls, llm: Any, sampling_params: Any, options: dict[str, Any]) -> RequestFeatures:
        try:
            names = {f.name for f in dataclasses.fields(sampling_params)}
        except TypeError:  # not a dataclass: assume the 1.0 fields only
            names = set()
        try:
            salted = all(
                "cache_salt" in inspect.signature(call).parameters
                for call in (llm.generate, llm.generate_async)
            )
        except (TypeError, ValueError):
            salted = False
        block = (options.get("kv_cache_config") or {}).get("tokens_per_block")
        backend = options.get("guided_decoding_backend") or None
        return cls(
            "return_perf_metrics" in names, salted, int(block or TOKENS_PER_BLOCK),
            guided_backend=str(backend) if backend else None,
        )  # fmt: skip

    def salt(self, request_id: str, cache_salt: str, use_cache: bool) -> dict[str, str]:
        """The generate kwargs that keep a request's blocks in its own namespace: the
        gateway's per-key salt, or one of its own when it may not use the cache at all."""
        if not self.cache_salt:
            return {}
        if not use_cache:
            return {"cache_salt": f"no-reuse:{request_id}"}
        return {"cache_salt": cache_salt} if cache_salt else {}

    def reused_tokens(self, out: Any, prompt_len: int) -> int:
        """Prompt tokens a request found in the prefix cache (0 where nothing says)."""
        cached = getattr(out, "cached_tokens", None)
        if isinstance(cached, int):
            return max(0, min(cached, prompt_len))
        metrics = getattr(out.outputs[0], "request_perf_metrics", None)
        kv = getattr(metrics, "kv_cache_metrics", None)
        blocks = getattr(kv, "num_reused_blocks", 0) or 0
        return max(0, min(int(blocks) * self.tokens_per_block, prompt_len))
