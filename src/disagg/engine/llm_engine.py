"""Prefill and decode engines: the two halves of a request, runnable in different processes
(the prefill half in engine/prefill_engine.py, re-exported here).

PrefillEngine.prefill(request)  -> PrefillResult (first token + portable KV payload)
DecodeEngine.add_request(...)    a sequence joins, with an imported KV payload
                                 (disaggregated) or with prompt ids (co-located: it
                                 prefills the sequence itself when admitting it)
DecodeEngine.step()              -> TokenOutputs; the loop is schedule / run / postprocess
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.contracts import DecodeStats
from disagg.engine.config import EngineConfig, aligned_chunk
from disagg.engine.grammar import guide_for
from disagg.engine.kv_payload import KVPayload
from disagg.engine.kv_reuse import complete_handoff, kv_reuse_for
from disagg.engine.model import KVCacheSlots, Llama
from disagg.engine.packed_prefill import Chunk
from disagg.engine.prefill_engine import PrefillEngine, PrefillResult, resolve_seed
from disagg.engine.prefix_cache import BlockHash
from disagg.engine.quant import DIRECT_ROWS
from disagg.engine.sampling import sample_batch, sample_one, token_logprobs
from disagg.engine.scheduler import Scheduler, SlotMove
from disagg.engine.sequence import (
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
    TokenLogprob,
    validate_request,
)
from disagg.errors import ConfigError, RequestError

Claim = tuple[Sequence, int, int]  # a chunk's sequence and the blocks [lo, hi) it computes
HashMemo = dict[str, list[BlockHash]]  # request id -> its prompt's block hashes
__all__ = ["DecodeEngine", "PrefillEngine", "PrefillResult", "TokenOutput", "resolve_seed"]


@dataclass(frozen=True)
class TokenOutput:
    """One event of a decode step for one request."""

    request_id: str
    token_id: int | None  # None: the sequence ended without producing a token this step
    index: int  # position of token_id in the output (0 = first token)
    finish_reason: FinishReason | None  # set on the request's last event
    num_reused_tokens: int = 0  # with index 0: prompt tokens the prefix cache gave
    logprob: TokenLogprob | None = None  # with token_id, when the request asks for logprobs


class DecodeEngine:
    """Continuous-batching decode over one model. Thread-safe for add/finish from other
    threads while one thread calls `step()`."""

    def __init__(
        self,
        model: Llama,
        config: EngineConfig,
        eos_token_ids: set[int],
        on_admit: Callable[[float, float | None], None] | None = None,
    ) -> None:
        if config.max_model_len > model.args.max_context:
            raise ConfigError(
                f"max_model_len {config.max_model_len} exceeds the engine's max_context "
                f"{model.args.max_context}; rebuild the engine with a larger --max-context"
            )
        # torch's decode path takes the dense kernel past DIRECT_ROWS rows (fused: the blocks)
        if model.blocks and not model.fused and config.max_num_seqs > DIRECT_ROWS:
            raise ConfigError(
                f"max_num_seqs {config.max_num_seqs}: at most {DIRECT_ROWS} with quantized "
                "weights (larger batches would change kernels); or set weights float32"
            )
        self.model = model
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.scheduler = Scheduler(config)
        self.kv_reuse = kv_reuse_for(model, config)
        self.cache = KVCacheSlots(
            model.args,
            config.max_num_seqs,
            config.max_model_len,
            prefault=config.prefault_kv,
            device=model.device,
        )
        self._seqs: dict[str, Sequence] = {}
        self._finish_requests: dict[str, FinishReason] = {}
        self._prefilled = 0
        self._lock = threading.Lock()
        self.num_steps = 0
        # (queue seconds, seconds of prefill done here or None) per admitted sequence: metrics
        self.on_admit = on_admit

    # ---------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        prompt_ids: list[int] | None = None,
        prefill: PrefillResult | None = None,
    ) -> None:
        """Queue a sequence: with `prefill` (its KV imported; `prompt_ids`, if given, name
        that K/V so that it joins the prefix cache too) or with `prompt_ids` alone (prefilled
        here, after what the prefix cache holds of it in `params.cache_salt`'s namespace).
        With `params.use_cache` False the cache is neither read nor written. A partial payload
        (kv.start > 0) gets its first positions from the cache now (no later eviction breaks
        it). Raises RequestError for bad input, CapacityError when the queue is full,
        KVPrefixMissError when the cache lacks that prefix."""
        if prompt_ids is None and prefill is None:
            raise RequestError("give prompt_ids, a prefill result, or both")
        pending = None
        if prefill is not None:
            prefill.kv.check_compatible(self.model.args)
            params.validate(self.model.args.vocab_size, self.config.max_tokens_limit)
            pending = complete_handoff(self.kv_reuse, prefill.kv, prompt_ids, params)
            if pending is not prefill.kv:  # made whole with the prompt ids the call carries
                validate_request(self.model.args, self.config, prompt_ids or [], params)
            prompt_len, output, seed = pending.num_tokens, [prefill.first_token], prefill.seed
            if prompt_ids is not None and len(prompt_ids) != prompt_len:
                prompt_ids = None  # not what the K/V were made from: not cached
            if prompt_ids is None and params.repetition_penalty != 1.0:
                raise RequestError("repetition_penalty needs the prompt ids with a KV hand-off")
        else:  # validate_request checks the sampling parameters too
            assert prompt_ids is not None  # (one of the two, checked above)
            validate_request(self.model.args, self.config, prompt_ids, params)
            prompt_len, output, seed = len(prompt_ids), [], resolve_seed(params)
        seq = Sequence(
            request_id,
            prompt_len,
            output,
            params,
            seed,
            self.eos_token_ids,
            pending_kv=pending,
            prompt_ids=list(prompt_ids) if prompt_ids is not None else [],
            use_cache=params.use_cache and self.kv_reuse is not None,
            guide=guide_for(self.model, self.eos_token_ids, params),
        )
        with self._lock:
            if request_id in self._seqs:
                raise RequestError(f"request id {request_id!r} is already in flight")
            self.scheduler.add(seq)
            self._seqs[request_id] = seq

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request at the next step (client cancel, stop string seen downstream)."""
        with self._lock:
            if request_id in self._seqs:
                self._finish_requests[request_id] = reason

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def stats(self) -> DecodeStats:
        bm, reuse = self.scheduler.block_manager, self.kv_reuse
        bytes_per_block = bm.block_size * self.model.args.kv_bytes_per_token
        return DecodeStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_steps=self.num_steps,
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_total=bm.num_blocks,
            kv_bytes_reserved=bm.num_used_blocks * bytes_per_block,
            kv_bytes_capacity=bm.num_blocks * bytes_per_block,
            prefix_cache=None if reuse is None else dataclasses.replace(reuse.index.stats),
        )

    # ---------------------------------------------------------------- the loop

    def step(self) -> list[TokenOutput]:
        """One engine step: admit what fits, prefill up to `prefill_chunk_tokens` of prompts
        decode prefills itself, then one decode step for every running sequence."""
        outputs: list[TokenOutput] = []
        with self._lock:
            for rid, reason in list(self._finish_requests.items()):
                self._finish(self._seqs[rid], reason, outputs)
            self._finish_requests.clear()
            admitted = self.scheduler.schedule()
        self._prefilled = 0  # prompt tokens computed this step (the burst cap counts them)
        done = [seq for seq in admitted if self._admit(seq, outputs)]
        done += self._prefill_chunks(outputs)
        with self._lock:
            for seq in done:
                self._finish(seq, self.scheduler.stop_reason(seq), outputs, announced=True)
        running = list(self.scheduler.running)
        ready = [s for s in running if not s.prefilling]
        if not ready:
            return outputs
        # A sequence still prefilling keeps its slot in the batch with a placeholder row: the
        # K/V that row writes land at its next chunk's first position, which the chunk then
        # overwrites, and its output is dropped. Rows are independent (batch invariance), so
        # the other sequences get what they would get without it.
        tokens = torch.tensor([0 if s.prefilling else s.last_token for s in running])
        positions = torch.tensor([s.num_cached_tokens for s in running])
        logits = self.model.decode(tokens, positions, self.cache).cpu()  # [B, V]: sampled here
        if len(ready) < len(running):
            logits = logits[[i for i, s in enumerate(running) if not s.prefilling]]
        new = sample_batch(
            logits,
            [s.params for s in ready],
            [s.seed for s in ready],
            [s.output_ids for s in ready],
            [s.prompt_ids for s in ready],
            self.eos_token_ids,
            [s.guide for s in ready],
        )
        logprobs = token_logprobs(logits, new, [s.params for s in ready])
        self.num_steps += 1
        with self._lock:
            finished = dict(self.scheduler.postprocess(ready, new))
            for seq, token, lp in zip(ready, new, logprobs, strict=True):
                index, finish = len(seq.output_ids) - 1, finished.get(seq)
                outputs.append(TokenOutput(seq.request_id, token, index, finish, logprob=lp))
            for seq, reason in finished.items():
                self._finish(seq, reason, outputs, announced=True)
        return outputs

    def _prefill_chunks(self, outputs: list[TokenOutput]) -> list[Sequence]:
        """Advance the prompts decode prefills in chunks, oldest first, within this step's
        token budget, all of this step's chunks in one forward (engine/packed_prefill.py).
        Returns the ones whose first token already ends them.

        Chunks protect a running batch from prompts: a step's chunk delays every decoding
        sequence once, each waiting prompt waits for every step its prefill takes. While
        fewer sequences decode than prompts wait (a burst of arrivals), the prompts are the
        many: they are prefilled whole, `burst_prefill_tokens` a step (a step's outputs go out
        when it ends: a cap lets the first prompts' first tokens leave while later prompts
        still wait), and the batch they join decodes at full size sooner; otherwise
        `prefill_chunk_tokens` a step."""
        prefilling = [s for s in self.scheduler.running if s.prefilling]
        decoding = len(self.scheduler.running) - len(prefilling)
        budget = self.config.prefill_chunk_tokens
        if decoding < len(prefilling):
            left = sum(s.prompt_len - s.num_cached_tokens for s in prefilling)
            budget = min(left, max(self.config.burst_prefill_tokens - self._prefilled, 0))
        planned: list[tuple[Sequence, Chunk]] = []
        claims: list[Claim] = []  # blocks this step's chunks compute
        hashes: HashMemo = {}  # each prompt's block hashes, once a step
        finishing = False  # a planned chunk ends its prompt: it decodes from this step on
        for seq in prefilling:
            assert seq.prefill_pos is not None  # (prefilling: it is)
            if budget <= 0:
                break
            prompt = seq.prompt_ids
            if seq.prefill_pos == 0:  # its first chunk: what is cached now is not computed
                if self._in_flight(seq, claims, hashes):
                    continue  # the next step finds those blocks cached
                seq.prefill_pos = self._reuse(seq)
            n = len(prompt) - seq.prefill_pos
            if finishing or self._others_decoding(seq):  # else nobody waits: the rest at once
                n = aligned_chunk(seq.prefill_pos, min(budget, n), len(prompt))
            chunk = Chunk(prompt[seq.prefill_pos : seq.prefill_pos + n], seq.prefill_pos, seq.slot)
            planned.append((seq, chunk))
            finishing = finishing or seq.prefill_pos + n == len(prompt)
            if self.kv_reuse is not None and seq.use_cache:
                bs = self.kv_reuse.block_size
                claims.append((seq, seq.prefill_pos // bs, (seq.prefill_pos + n) // bs))
            budget -= n
        if not planned:
            return []
        logits = self.model.prefill_chunks([c for _, c in planned], self.cache)
        done: list[Sequence] = []
        for (seq, chunk), seq_logits in zip(planned, logits, strict=True):
            assert seq.prefill_pos is not None
            seq.prefill_pos += len(chunk.token_ids)
            if seq.prefill_pos < seq.prompt_len:
                continue
            reason = self._first_token(seq, seq_logits, outputs)
            self._admitted_hook(seq, time.perf_counter() - seq.admitted_s)
            if reason is not None:
                done.append(seq)
        return done

    def _in_flight(self, seq: Sequence, claims: list[Claim], hashes: HashMemo) -> bool:
        """Whether the first block `seq` would compute (past its cached prefix) is one another
        chunk of this step computes: then `seq` waits a step and takes it from the cache
        instead of computing it twice (prompts sharing a system prompt, arriving together)."""
        if not claims or self.kv_reuse is None or not seq.use_cache:
            return False
        reuse = self.kv_reuse

        def of(s: Sequence) -> list[BlockHash]:
            if s.request_id not in hashes:
                hashes[s.request_id] = reuse.hashes(s.prompt_ids, s.params.cache_salt)
            return hashes[s.request_id]

        first = reuse.peek(seq) // reuse.block_size
        computing = {h for s, lo, hi in claims for h in of(s)[lo:hi]}
        return first < len(of(seq)) and of(seq)[first] in computing

    def _reuse(self, seq: Sequence) -> int:
        """Copy what the prefix cache holds of the prompt into the slot: how many tokens."""
        if seq.use_cache:
            assert self.kv_reuse is not None
            hit = self.kv_reuse.load_prompt(
                seq.prompt_ids, seq.params.cache_salt, self.cache, seq.slot
            )
            seq.num_reused_tokens = hit.num_cached_tokens
        return seq.num_reused_tokens

    def _first_token(
        self, seq: Sequence, logits: torch.Tensor, outputs: list[TokenOutput]
    ) -> FinishReason | None:
        """The prompt is in the slot: keep its blocks for later prompts, sample the first
        token. Returns why it already ends the sequence, if it does."""
        if seq.use_cache:
            assert self.kv_reuse is not None
            self.kv_reuse.keep(seq, self.cache)
        logits = logits.cpu()
        first = sample_one(
            logits, seq.params, seq.seed, [], seq.prompt_ids, self.eos_token_ids, seq.guide
        )
        lp = token_logprobs(logits[None], [first], [seq.params])[0]
        seq.output_ids.append(first)
        reason = self.scheduler.stop_reason(seq)
        outputs.append(
            TokenOutput(seq.request_id, first, 0, reason, seq.num_reused_tokens, logprob=lp)
        )
        return reason

    def _others_decoding(self, seq: Sequence) -> bool:
        """Whether a sequence other than `seq` is decoding: only then is a prompt chunked
        (alone, a whole prefill is the fastest way to its first token)."""
        return any(s is not seq and not s.prefilling for s in self.scheduler.running)

    def _admitted_hook(self, seq: Sequence, prefill_s: float | None) -> None:
        if self.on_admit is not None:
            try:
                self.on_admit(seq.admitted_s - seq.arrival_s, prefill_s)
            except Exception:  # metrics must never stop decoding
                logging.getLogger("disagg.engine.llm_engine").exception("on_admit hook failed")

    def _admit(self, seq: Sequence, outputs: list[TokenOutput]) -> bool:
        """Write the sequence's prompt K/V into its slot (prefilling it here if it came
        without, whole when it fits this step's chunk budget, else in chunks from this step
        on). Returns True if its first token already ends it."""
        seq.admitted_s = time.perf_counter()
        prefill_here = seq.pending_kv is None
        cached = self.kv_reuse.peek(seq) if prefill_here and self.kv_reuse else 0
        long = seq.prompt_len - cached > self.config.prefill_chunk_tokens
        if prefill_here and long and self._others_decoding(seq):
            seq.prefill_pos = 0  # _prefill_chunks takes it from here
            return False
        done = self._admit_kv(seq, outputs)
        self._admitted_hook(seq, time.perf_counter() - seq.admitted_s if prefill_here else None)
        return done

    def _admit_kv(self, seq: Sequence, outputs: list[TokenOutput]) -> bool:
        if seq.pending_kv is not None:
            kv: KVPayload = seq.pending_kv
            self.cache.write(seq.slot, kv.k, kv.v)
            seq.pending_kv = None
            reason = self.scheduler.stop_reason(seq)  # the imported first token may end it
            if reason is not None:
                outputs.append(TokenOutput(seq.request_id, None, len(seq.output_ids), reason))
        else:
            prompt, n = seq.prompt_ids, self._reuse(seq)
            self._prefilled += len(prompt) - n
            if n:  # positions 0..n-1 came from the prefix cache
                logits = self.model.prefill_chunk(prompt[n:], n, self.cache, seq.slot)
            else:
                logits, k, v = self.model.prefill(prompt)
                self.cache.write(seq.slot, k, v)
            reason = self._first_token(seq, logits, outputs)
        return reason is not None

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason | None,
        outputs: list[TokenOutput],
        announced: bool = False,
    ) -> None:
        """Take a sequence out (caller holds the lock) and keep the KV slots compact."""
        assert reason is not None
        if seq.is_finished:
            return
        if seq.use_cache and seq.status is SequenceStatus.RUNNING:
            assert self.kv_reuse is not None
            self.kv_reuse.keep(seq, self.cache)  # before another sequence reuses the slot
        move: SlotMove | None = self.scheduler.finish(seq, reason)
        if move is not None:
            self.cache.move(move.src, move.dst, move.num_tokens)
        self._seqs.pop(seq.request_id, None)
        self._finish_requests.pop(seq.request_id, None)
        if not announced:
            outputs.append(TokenOutput(seq.request_id, None, len(seq.output_ids), reason))
