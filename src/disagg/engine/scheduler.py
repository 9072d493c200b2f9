"""Continuous batching for decode: sequences join and leave the batch between steps.

Design: every running sequence owns one KV slot, and running sequences always occupy
slots 0..B-1, so a decode step reads K/V as one strided view instead of gathering. When a
sequence leaves, the one in the last slot moves into its place (`SlotMove`, applied to the
KV cache by the engine). Admission is FIFO and waits while the batch is full or the KV
budget (`BlockManager`) cannot reserve prompt + max_tokens; a request that could never
fit is refused at once, and so is one arriving when the waiting queue is full.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from disagg.engine.block_manager import BlockManager
from disagg.engine.config import EngineConfig
from disagg.engine.sequence import FinishReason, Sequence, SequenceStatus
from disagg.errors import CapacityError, RequestError


@dataclass(frozen=True)
class SlotMove:
    """Copy the first `num_tokens` KV positions of slot `src` into slot `dst`."""

    src: int
    dst: int
    num_tokens: int


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i].slot == i

    def add(self, seq: Sequence) -> None:
        if seq.max_num_tokens > self.config.max_model_len:
            raise RequestError(
                f"prompt ({seq.prompt_len} tokens) + max_tokens ({seq.params.max_tokens}) "
                f"exceeds the context limit of {self.config.max_model_len} tokens"
            )
        if not self.block_manager.can_ever_allocate(seq.max_num_tokens):
            raise RequestError(
                f"request needs {seq.max_num_tokens} KV positions, more than the whole "
                f"KV budget ({self.block_manager.num_blocks * self.block_manager.block_size})"
            )
        if len(self.waiting) >= self.config.max_queue:
            raise CapacityError(f"decode queue full ({self.config.max_queue} waiting); retry later")
        self.waiting.append(seq)

    def schedule(self) -> list[Sequence]:
        """Admit waiting sequences while a slot and their KV reservation are free.
        Returns the newly admitted ones; they are now at the end of `running`."""
        admitted = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq.max_num_tokens):
                break  # FIFO: later requests do not overtake a large one
            self.waiting.popleft()
            self.block_manager.allocate(seq.request_id, seq.max_num_tokens)
            seq.status, seq.slot = SequenceStatus.RUNNING, len(self.running)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def finish(self, seq: Sequence, reason: FinishReason) -> SlotMove | None:
        """Take `seq` out (waiting or running). Returns the slot move that keeps the running
        sequences compact, if one is needed."""
        if seq.is_finished:
            return None
        was_running = seq.status is SequenceStatus.RUNNING
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if not was_running:
            self.waiting.remove(seq)
            return None
        self.block_manager.free(seq.request_id)
        last = self.running.pop()
        move = None
        if last is not seq:
            move = SlotMove(src=last.slot, dst=seq.slot, num_tokens=last.num_cached_tokens)
            self.running[seq.slot] = last
            last.slot = seq.slot
        seq.slot = -1
        return move

    def postprocess(
        self, seqs: list[Sequence], token_ids: list[int]
    ) -> list[tuple[Sequence, FinishReason]]:
        """Record one sampled token per running sequence, then finish the ones that are done.

        Every token is appended before any sequence leaves: a leaving sequence moves another
        into its slot, and that move must carry the K/V the step just wrote."""
        reasons = [self.append_token(seq, t) for seq, t in zip(seqs, token_ids, strict=True)]
        return [(seq, r) for seq, r in zip(seqs, reasons, strict=True) if r is not None]

    def append_token(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Record a sampled token; returns why the sequence is now done, if it is."""
        seq.output_ids.append(token_id)
        return self.stop_reason(seq)

    def stop_reason(self, seq: Sequence) -> FinishReason | None:
        """EOS and stop tokens end a sequence only after min_tokens others (sampling masks
        them before, so one here came from elsewhere: a hand-off, a scripted test); its
        grammar ends it when complete, whatever ignore_eos and min_tokens say."""
        if (grammar := seq.grammar_stop()) is not None:  # complete, or at a dead end
            return grammar
        token = seq.last_token
        may_stop = len(seq.output_ids) > seq.params.min_tokens  # (the token's index >= it)
        if may_stop and (
            (not seq.params.ignore_eos and token in seq.eos_token_ids)
            or token in seq.params.stop_token_ids
        ):
            return FinishReason.STOP
        if len(seq.output_ids) >= seq.params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None
