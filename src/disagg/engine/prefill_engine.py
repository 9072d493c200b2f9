"""The prefill half of a request: `PrefillEngine.prefill` -> `PrefillResult` (the first token
and a portable KV payload), runnable in a process of its own (engine/llm_engine.py).

Cancellation: a prefill whose client went away stops at its next layer (`is_cancelled` is
asked before each; RequestCancelledError), so the worker takes its next request within one
layer's work: 1/30 of the prompt, ~0.2 s for 2,000 tokens on 2 idle cores. Why layers, not
chunks of tokens (as decode prefills beside its batch): the same bound at no cost, and the
same numbers as an uncancelled prefill. A 2,000-token prompt in Llama.prefill_chunk's
chunks took 7.9 s (128 tokens, each 0.37-0.63 s) and 9.7 s (64, 0.26-0.45 s) against 6.4 s
whole, measured side by side here, and chunks change the payload's K/V in the last bits.
Served figures: benchmarks/cancel_bench.py, docs/reliability.md.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from disagg.engine.config import EngineConfig
from disagg.engine.grammar import guide_for
from disagg.engine.kv_payload import KVPayload, check_start
from disagg.engine.kv_reuse import kv_reuse_for
from disagg.engine.model import KVCacheSlots, Llama
from disagg.engine.prefault import zeros_kv
from disagg.engine.sampling import sample_one, token_logprobs
from disagg.engine.sequence import SamplingParams, TokenLogprob, validate_request


@dataclass(frozen=True)
class PrefillResult:
    """What prefill hands to decode (the orchestrator streams `first_token` at once)."""

    request_id: str
    first_token: int  # output token 0, sampled with (seed, 0)
    kv: KVPayload  # the prompt's K/V from position kv.start (0, unless decode holds those)
    seed: int  # effective seed, so decode continues the same random stream
    prefill_time_s: float
    num_reused_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    first_logprob: TokenLogprob | None = None  # when the request asks for logprobs


def resolve_seed(params: SamplingParams) -> int:
    return params.seed if params.seed is not None else secrets.randbits(63)


class PrefillEngine:
    def __init__(
        self,
        model: Llama,
        config: EngineConfig,
        reuse_kv_buffers: bool = False,
        eos_token_ids: Collection[int] = (),
    ) -> None:
        """With `reuse_kv_buffers`, every result's K/V are views of one pair of buffers,
        valid until the next prefill: for a server that packs each result at once.
        `eos_token_ids`: the model's, masked from the first token while min_tokens asks for
        more (as decode masks them)."""
        self.model = model
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_reuse = kv_reuse_for(model, config)
        # a cached prefix is copied here and the rest of the prompt prefilled after it
        self._scratch = KVCacheSlots(model.args, 1, config.max_model_len, device=model.device)
        # (calloc'd: costs memory only where a prompt with a cached prefix writes it)
        self._kv_buffers = None
        if reuse_kv_buffers and model.device.type == "cpu":
            a = model.args
            shape = (a.n_layers, a.n_kv_heads, config.max_model_len, a.head_dim)
            self._kv_buffers = zeros_kv(shape, model.device)

    def prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        skip_tokens: int = 0,
        is_cancelled: Callable[[], bool] | None = None,
    ) -> PrefillResult:
        """The prompt's first token and its K/V from position `skip_tokens` (decode holds those
        before it); a prefix cached here (in params.cache_salt's namespace) is copied, not
        recomputed (params.use_cache False: neither read nor written). Raises
        RequestCancelledError when `is_cancelled` says so between two layers."""
        validate_request(self.model.args, self.config, prompt_ids, params)
        check_start(skip_tokens, len(prompt_ids), self.config.block_size)
        guide = guide_for(self.model, self.eos_token_ids, params)  # (compiled before work)
        start = time.perf_counter()
        reuse, salt = (self.kv_reuse if params.use_cache else None), params.cache_salt
        hit = reuse.load_prompt(prompt_ids, salt, self._scratch, 0) if reuse else None
        if hit is not None and hit.num_cached_tokens:
            n = hit.num_cached_tokens
            logits = self.model.prefill_chunk(prompt_ids[n:], n, self._scratch, 0, is_cancelled)
            s = len(prompt_ids)
            k, v = self._scratch.k[:, 0, :, :s], self._scratch.v[:, 0, :, :s]
        else:
            logits, k, v = self.model.prefill(
                prompt_ids, kv_out=self._kv_buffers, stop=is_cancelled
            )
        if reuse is not None and hit is not None:  # (both or neither)
            reuse.save(prompt_ids, salt, k, v, hashes=hit.hashes)
        seed = resolve_seed(params)
        logits = logits.cpu()
        first = sample_one(logits, params, seed, [], prompt_ids, self.eos_token_ids, guide)
        lp = token_logprobs(logits[None], [first], [params])[0]
        k, v = k[:, :, skip_tokens:], v[:, :, skip_tokens:]  # views: pack copies only these
        kv = KVPayload.from_arrays(self.model.args, k.cpu().numpy(), v.cpu().numpy(), skip_tokens)
        reused = hit.num_cached_tokens if hit else 0
        elapsed = time.perf_counter() - start
        return PrefillResult(request_id, first, kv, seed, elapsed, reused, lp)
