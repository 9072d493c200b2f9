"""A decode engine that computes nothing: what each step would run, for the simulator.

MIRROR of engine/llm_engine.py `DecodeEngine` (`add_request`, `step`, `_admit`, `_admit_kv`,
`_prefill_chunks`, `_first_token`, `_others_decoding`, `_finish`). Admission, slots, the
KV budget and stop conditions are the real `Scheduler` and `BlockManager` on real
`Sequence`s; the step's own logic (who is admitted whole and who in chunks, the chunk and
burst budgets, the placeholder rows of sequences still prefilling) is copied line for line
with each model call replaced by the work it would do (`StepWork`). The copy leaves out
what the simulator does not model: the prefix cache (every prompt is computed in full),
client cancels (`finish_request`), and the on_admit metrics hook.
tests/unit/test_planner_mirror.py runs the real engine (a model that records its calls) and
this one on the same requests and asserts the same work and outputs, step by step: a change
to the engine's step that is not made here fails it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.engine.config import EngineConfig, aligned_chunk
from disagg.engine.scheduler import Scheduler
from disagg.engine.sequence import FinishReason, SamplingParams, Sequence
from disagg.errors import RequestError
from disagg.planner.profile import Profile

# kinds of work in a step, each (kind, a, b):
PREFILL = "prefill"  # (prompt tokens, 0): Llama.prefill of a whole prompt
CHUNK = "chunk"  # (tokens, start): Llama.prefill_chunk
DECODE = "decode"  # (rows, positions): Llama.decode over the batch, sampling
KV_WRITE = "kv_write"  # (tokens, 0): KVCacheSlots.write of a prompt's K/V into a slot
KV_MOVE = "kv_move"  # (tokens, 0): KVCacheSlots.move after a sequence left
SIM_TOKEN = 1  # what every simulated step samples (never an end-of-sequence token)


@dataclass
class StepWork:
    """The model calls of one step, in order: (kind, a, b) as above."""

    ops: list[tuple[str, int, int]] = field(default_factory=list)

    def add(self, kind: str, a: int, b: int = 0) -> None:
        self.ops.append((kind, a, b))

    def seconds(self, profile: Profile) -> float:
        """How long the step takes on the profiled machine."""
        total, prefill, decode = 0.0, False, False
        for kind, a, b in self.ops:
            if kind == PREFILL:
                total, prefill = total + profile.prefill(a), True
            elif kind == CHUNK:
                total, prefill = total + profile.chunk(a, b), True
            elif kind == DECODE:
                total, decode = total + profile.decode(a, b), True
            else:  # KV_WRITE, KV_MOVE: copies of a prompt's K/V
                total += profile.kv_write(a * profile.kv_bytes_per_token)
        return total * (profile.mixed_factor if prefill and decode else 1.0)


@dataclass(frozen=True)
class SimHandoff:
    """What a simulated prefill hands to decode (the real one: llm_engine.PrefillResult)."""

    num_tokens: int  # prompt tokens whose K/V came
    first_token: int = SIM_TOKEN
    seed: int = 0


@dataclass(frozen=True)
class SimTokenOutput:
    """llm_engine.TokenOutput's fields (what DecodeService delivers from)."""

    request_id: str
    token_id: int | None
    index: int
    finish_reason: FinishReason | None
    num_reused_tokens: int = 0
    logprob: None = None  # (simulated time computes no distributions)


class SimDecodeEngine:
    """One decode instance's state; `step()` returns the work and the outputs of a step."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self._seqs: dict[str, Sequence] = {}
        self._imported: set[str] = set()  # sequences whose K/V came with them (pending_kv)
        self._prefilled = 0
        self.num_steps = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        prompt_ids: list[int] | None = None,
        prefill: SimHandoff | None = None,
    ) -> None:
        """As DecodeEngine.add_request (only the length of `prompt_ids` matters here).
        Raises RequestError (too long) or CapacityError (queue full) as the real one does."""
        if prompt_ids is None and prefill is None:
            raise RequestError("give prompt_ids, a prefill result, or both")
        if prefill is not None:
            prompt_len, output, seed = prefill.num_tokens, [prefill.first_token], prefill.seed
        else:
            assert prompt_ids is not None
            prompt_len, output, seed = len(prompt_ids), [], 0
        seq = Sequence(request_id, prompt_len, output, params, seed, frozenset(), arrival_s=0.0)
        if request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already in flight")
        self.scheduler.add(seq)
        self._seqs[request_id] = seq
        if prefill is not None:
            self._imported.add(request_id)

    # ---------------------------------------------------------------- the loop (mirrored)

    def step(self) -> tuple[StepWork, list[SimTokenOutput]]:
        work, outputs = StepWork(), list[SimTokenOutput]()
        admitted = self.scheduler.schedule()
        self._prefilled = 0
        done = [seq for seq in admitted if self._admit(seq, outputs, work)]
        done += self._prefill_chunks(outputs, work)
        for seq in done:
            self._finish(seq, self.scheduler.stop_reason(seq), outputs, work, announced=True)
        running = list(self.scheduler.running)
        ready = [s for s in running if not s.prefilling]
        if not ready:
            return work, outputs
        # placeholder rows for sequences still prefilling: the batch is every running slot
        work.add(DECODE, len(running), max(s.num_cached_tokens for s in running) + 1)
        new = [SIM_TOKEN] * len(ready)
        self.num_steps += 1
        finished = dict(self.scheduler.postprocess(ready, new))
        for seq, token in zip(ready, new, strict=True):
            finish = finished.get(seq)
            outputs.append(SimTokenOutput(seq.request_id, token, len(seq.output_ids) - 1, finish))
        for seq, reason in finished.items():
            self._finish(seq, reason, outputs, work, announced=True)
        return work, outputs

    def _prefill_chunks(self, outputs: list[SimTokenOutput], work: StepWork) -> list[Sequence]:
        prefilling = [s for s in self.scheduler.running if s.prefilling]
        decoding = len(self.scheduler.running) - len(prefilling)
        budget = self.config.prefill_chunk_tokens
        if decoding < len(prefilling):
            left = sum(s.prompt_len - s.num_cached_tokens for s in prefilling)
            budget = min(left, max(self.config.burst_prefill_tokens - self._prefilled, 0))
        done: list[Sequence] = []
        for seq in prefilling:
            assert seq.prefill_pos is not None
            if budget <= 0:
                break
            n = seq.prompt_len - seq.prefill_pos
            if self._others_decoding(seq):
                n = aligned_chunk(seq.prefill_pos, min(budget, n), seq.prompt_len)
            work.add(CHUNK, n, seq.prefill_pos)
            seq.prefill_pos += n
            budget -= n
            if seq.prefill_pos < seq.prompt_len:
                continue
            if self._first_token(seq, outputs) is not None:
                done.append(seq)
        return done

    def _first_token(self, seq: Sequence, outputs: list[SimTokenOutput]) -> FinishReason | None:
        seq.output_ids.append(SIM_TOKEN)
        reason = self.scheduler.stop_reason(seq)
        outputs.append(SimTokenOutput(seq.request_id, SIM_TOKEN, 0, reason))
        return reason

    def _others_decoding(self, seq: Sequence) -> bool:
        return any(s is not seq and not s.prefilling for s in self.scheduler.running)

    def _admit(self, seq: Sequence, outputs: list[SimTokenOutput], work: StepWork) -> bool:
        prefill_here = seq.request_id not in self._imported
        long = seq.prompt_len > self.config.prefill_chunk_tokens
        if prefill_here and long and self._others_decoding(seq):
            seq.prefill_pos = 0
            return False
        return self._admit_kv(seq, outputs, work)

    def _admit_kv(self, seq: Sequence, outputs: list[SimTokenOutput], work: StepWork) -> bool:
        if seq.request_id in self._imported:
            work.add(KV_WRITE, seq.prompt_len)
            self._imported.discard(seq.request_id)
            reason = self.scheduler.stop_reason(seq)
            if reason is not None:
                outputs.append(SimTokenOutput(seq.request_id, None, len(seq.output_ids), reason))
        else:
            self._prefilled += seq.prompt_len
            work.add(PREFILL, seq.prompt_len)
            work.add(KV_WRITE, seq.prompt_len)
            reason = self._first_token(seq, outputs)
        return reason is not None

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason | None,
        outputs: list[SimTokenOutput],
        work: StepWork,
        announced: bool = False,
    ) -> None:
        assert reason is not None
        if seq.is_finished:
            return
        move = self.scheduler.finish(seq, reason)
        if move is not None:
            work.add(KV_MOVE, move.num_tokens)
        self._seqs.pop(seq.request_id, None)
        self._imported.discard(seq.request_id)
        if not announced:
            outputs.append(SimTokenOutput(seq.request_id, None, len(seq.output_ids), reason))
