"""Orchestration of one generate request across the prefill and decode pools. No Triton here.

    prefill pool --(first token + KV payload bytes)--> orchestrator --> decode pool
         |                                                 |
         `--- fails or times out: decode prefills itself --'   (nothing is lost)

The payload leaves out the leading blocks decode probably holds (pipeline/handoff.py); when
decode lacks them after all, the whole prompt's K/V is handed off again.

The pools are interfaces: `local.py` implements them in this process, `triton/pools.py` with
BLS calls into this Triton server, `remote/` over gRPC. The orchestrator turns tokens into
text (whole characters, stop strings) so that streamed deltas concatenate exactly to the
full reply: the one token -> text loop of the Triton models and of `disagg.llm` alike.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

from disagg import contracts as C
from disagg.contracts import (
    COLOCATED,
    CONDITIONAL,
    DISAGGREGATED,
    FALLBACK,
    MODES,
    DecodeStep,
    Handoff,
    Reply,
)
from disagg.engine.config import EngineConfig, ModelArgs
from disagg.engine.grammar import check_guide
from disagg.engine.sequence import FinishReason, TokenLogprob, validate_request
from disagg.engine.tokenizer import TextStream, Tokenizer
from disagg.errors import KVPayloadError, KVPrefixMissError, PoolError
from disagg.pipeline.conditional import CostModel, LoadTracker
from disagg.pipeline.handoff import kv_path, skip_tokens
from disagg.pipeline.interfaces import DecodePool, OrchestratorEvents, PrefillPool
from disagg.pipeline.prefix_locality import DECODE, PREFILL, PrefixLocality
from disagg.pipeline.recovery import DecodeRecovery
from disagg.pipeline.request import GenerateRequest, RequestRun, logprob_object

log = logging.getLogger("disagg.orchestrator")


class Orchestrator:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_args: ModelArgs,
        engine_config: EngineConfig,
        prefill_pool: PrefillPool | None,
        decode_pool: DecodePool,
        mode: str = DISAGGREGATED,
        events: OrchestratorEvents | None = None,
        cost_model: CostModel | None = None,
        migration_limit: int = 0,
        locality: PrefixLocality | None = None,
        decode_recover_s: float = 0.0,
    ) -> None:
        """`migration_limit`: how many times a request whose decode failed mid-stream is
        continued by another decode (another instance or replica, or the restarted one), which
        prefills the prompt plus the tokens already sent and goes on. `decode_recover_s`: how
        long, after a failure, decode may refuse the request (restarting, no replica up)
        before it fails; 0: at once. `locality`: where the pools probably hold each prompt's
        K/V (conditional mode)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.tokenizer = tokenizer
        self.model_args = model_args
        self.engine_config = engine_config
        self.prefill_pool = prefill_pool
        self.decode_pool = decode_pool
        self.mode = mode
        self.events = events or OrchestratorEvents()
        self.cost_model = cost_model or CostModel()
        self.migration_limit = migration_limit
        self.decode_recover_s = decode_recover_s
        self.recover_poll_s = 0.25  # between tries while decode refuses a request
        self.locality = locality
        self.load = LoadTracker(on_change=self.events.load)
        self.eos = {tokenizer.eos_token_id} - {None}

    def check_request(self, req: GenerateRequest) -> None:
        """Everything the engines would refuse, refused here first, before any pool works."""
        validate_request(self.model_args, self.engine_config, req.prompt_ids, req.params)
        check_guide(self.tokenizer, self.model_args.vocab_size, req.params)

    def run(
        self,
        req: GenerateRequest,
        emit: Callable[[Reply], None],
        is_cancelled: Callable[[], bool] = lambda: False,
    ) -> Reply:
        """Serve one request; streaming deltas go to `emit`, the final Reply is returned.
        Raises RequestError (bad input) or PoolError (decode failed mid-request)."""
        self.check_request(req)
        run = RequestRun(req, TextStream(self.tokenizer, req.params.stop), emit, is_cancelled)
        run.handoff = self._prefill(run)
        if run.is_cancelled():  # the client left during prefill: decode gets nothing
            return run.abandon()
        try:
            finish = self._first_and_decode(run)
        except BaseException:
            run.release_unclaimed()
            raise
        if finish == FinishReason.ABORT.value:
            run.release_unclaimed()
        self.events.finished(run.served_by, finish, time.perf_counter() - req.arrival_s)
        if run.handoff is not None and run.handoff.kv_start:  # what decode took from its cache
            self.events.kv_handoff_skipped(
                run.handoff.kv_start * self.model_args.kv_bytes_per_token
            )
        self._record_locality(run)
        self.events.cached_tokens(run.num_cached_tokens)
        return run.final_reply(finish)

    def _first_and_decode(self, run: RequestRun) -> str:
        """The first token (prefill's, when it was handed off), then decode's."""
        if run.handoff is not None:
            self._token_times(run)
            first = run.handoff.first_logprob
            self._add_tokens(run, [run.handoff.first_token], None if first is None else [first])
        self.load.add_decode(1)
        try:
            return self._decode_migrating(run)
        finally:
            self.load.add_decode(-1)

    def _record_locality(self, run: RequestRun) -> None:
        """Where the request's blocks were left: decode keeps prompt and reply (handed off
        or prefilled there), the prefill pool the prompt it prefilled."""
        params = run.request.params
        if self.locality is None or not params.use_cache:
            return
        prompt = run.request.prompt_ids
        self.locality.record(DECODE, prompt + run.token_ids[:-1], params.cache_salt)
        if run.served_by == DISAGGREGATED:
            self.locality.record(PREFILL, prompt, params.cache_salt)

    def _decode_migrating(self, run: RequestRun) -> str:
        """Decode, continued by another decode when it fails (pipeline/recovery.py): the
        next one prefills the prompt plus every token already produced and goes on, so the
        client's stream continues with no text repeated or lost (greedy replies equal an
        undisturbed run's). A KV payload that could not be pulled continues the same way."""
        recovery = DecodeRecovery(
            self.migration_limit, self.decode_recover_s, run.is_cancelled, self.recover_poll_s
        )
        while True:
            try:
                return self._decode_resending(run)
            except PoolError as e:
                serving = bool(run.decode_pid)  # decode had acknowledged it: a fault
                if run.text.stopped or not recovery.may_retry(serving):
                    self.events.error("decode", "pool")
                    if recovery.expired:
                        raise recovery.error(e) from e
                    raise
                left = run.request.params.max_tokens - run.num_output_tokens
                if left <= 0:
                    return FinishReason.LENGTH.value
                if serving:
                    log.warning(
                        "request %s: %s; another decode continues it after %d tokens",
                        run.request.request_id, e, run.num_output_tokens,
                    )  # fmt: skip
                    self.events.error("decode", "migrated")
                run.release_unclaimed()  # (a decode that failed before taking its hand-off)
                run.decode_pid = 0
                self._continue_from_tokens(run, left)

    def _continue_from_tokens(self, run: RequestRun, left: int) -> None:
        """Decode goes on by prefilling the prompt plus every token already sent (under a
        child id: the first attempt's may still be known to decode)."""
        req = run.request
        run.handoff = None
        run.current = dataclasses.replace(
            req,
            request_id=C.child_request_id(req.request_id),
            prompt_ids=req.prompt_ids + run.token_ids,
            # (the tokens so far become prompt: presence/frequency penalties stop counting
            # them, repetition_penalty does not; the grammar has consumed them)
            params=dataclasses.replace(
                req.params,
                max_tokens=left,
                min_tokens=max(req.params.min_tokens - run.num_output_tokens, 0),
                guide_tokens=(*req.params.guide_tokens, *run.token_ids)
                if req.params.guide_type
                else (),
            ),
        )

    def _decode_resending(self, run: RequestRun) -> str:
        """Decode; when decode lacks the prefix a partial hand-off left out, hand the whole
        prompt's K/V off and decode again (pipeline/handoff.py)."""
        try:
            return self._decode(run)
        except KVPayloadError as e:  # the hand-off failed: decode prefills the prompt itself
            if run.handoff is None:
                raise
            log.warning("request %s: %s; decode prefills it", run.request.request_id, e)
            self.events.error("kv_handoff", "transfer")
            run.release_unclaimed()
            run.decode_pid, run.served_by = 0, FALLBACK
            return self._decode_from_tokens(run)
        except KVPrefixMissError as e:
            if run.handoff is None or not run.handoff.kv_start:  # (a whole one cannot miss)
                raise PoolError(str(e)) from e
            log.info("request %s: %s; handing off the whole prompt", run.request.request_id, e)
            self.events.kv_prefix_miss()
            run.decode_pid = 0
            try:
                run.handoff = self._prefill_whole(run, run.handoff)
            except PoolError as pe:  # decode prefills it then, from the tokens already sent
                log.warning("request %s: %s; decode prefills it", run.request.request_id, pe)
                self.events.error("prefill", "pool")
                return self._decode_from_tokens(run)
            return self._decode(run)

    def _decode_from_tokens(self, run: RequestRun) -> str:
        """Decode without a hand-off: it prefills the prompt and the tokens already sent."""
        left = run.request.params.max_tokens - run.num_output_tokens
        if left <= 0:
            return FinishReason.LENGTH.value
        self._continue_from_tokens(run, left)
        return self._decode(run)

    def _prefill_whole(self, run: RequestRun, partial: Handoff) -> Handoff:
        """The prompt's whole K/V, continuing from the first token already sent (and with its
        seed: the random stream decode continues)."""
        req = run.request
        assert self.prefill_pool is not None  # (the partial hand-off came from it)
        start = time.perf_counter()
        try:
            whole = self.prefill_pool.prefill(req.request_id, req.prompt_ids, req.params)
        except PoolError as e:
            raise PoolError(f"decode lacked the prompt's prefix, and prefill failed: {e}") from e
        return dataclasses.replace(
            whole,
            first_token=partial.first_token,
            seed=partial.seed,
            call_time_s=time.perf_counter() - start,  # (the hand-off's cost is learned from it)
        )

    def _decode(self, run: RequestRun) -> str:
        current = run.current
        steps = self.decode_pool.generate(
            current.request_id,
            current.params,
            handoff=run.handoff,
            prompt_ids=current.prompt_ids,
        )
        try:
            return self._decode_steps(run, steps)
        except KVPrefixMissError:  # decode refused it before it began: nothing to stop
            raise
        except BaseException:  # emit failed (the caller is gone) or decode did: stop decode
            self.decode_pool.cancel(current.request_id)
            raise

    def _decode_steps(self, run: RequestRun, steps: Iterator[DecodeStep]) -> str:
        current, handoff = run.current, run.handoff
        finish: str | None = None
        sent = time.perf_counter()
        # a prompt decode prefills itself: the next ones decode prefills wait for it (the cost
        # model's Q_local) until its first token
        local = self.load.local_prefill(len(current.prompt_ids) if handoff is None else 0)
        with local:
            for step in steps:
                if not run.decode_pid and handoff is not None:  # decode's acknowledgement
                    self._handoff_done(run, handoff, time.perf_counter() - sent)
                run.decode_pid = step.worker_pid
                if step.num_cached_tokens and run.current is run.request:  # decode prefilled it
                    run.num_cached_tokens = step.num_cached_tokens
                if step.token_ids and handoff is None and run.last_token_s is None:
                    # decode prefilled this prompt itself: how fast, for the cost model
                    self.cost_model.observe_local_prefill(
                        len(current.prompt_ids),
                        time.perf_counter() - sent,
                        run.decode_beside,
                        local.ahead,
                    )
                if step.token_ids:
                    local.done()
                    self._token_times(run, len(step.token_ids))
                if finish is None:  # after a stop string or a cancel, drain without adding text
                    self._add_tokens(run, step.token_ids, step.logprobs)
                    if run.text.stopped:
                        finish = FinishReason.STOP.value
                        self.decode_pool.cancel(current.request_id)
                    elif run.is_cancelled():
                        finish = FinishReason.ABORT.value
                        self.decode_pool.cancel(current.request_id)
                if step.finish_reason is not None:
                    finish = finish or step.finish_reason
        if finish is None:
            raise PoolError("decode stream ended without a finish reason")
        return finish

    def _token_times(self, run: RequestRun, num_tokens: int = 1) -> None:
        """Token timing: TTFT on the first, the gap since the last response per token after."""
        now = time.perf_counter()
        if run.last_token_s is None:
            self.events.first_token(run.served_by, now - run.request.arrival_s)
            num_tokens, gap = num_tokens - 1, 0.0  # the rest of the first response came with it
        else:
            gap = (now - run.last_token_s) / max(num_tokens, 1)
        if num_tokens > 0:
            self.events.token_gap(run.served_by, gap, num_tokens)
            if gap > 0:
                busy = self.load.snapshot().prefill_queue_tokens > 0
                self.cost_model.observe_gap(gap, busy)
        run.last_token_s = now

    def _handoff_done(self, run: RequestRun, handoff: Handoff, accept_s: float) -> None:
        # prefill side: call time less queue and compute; decode side: send -> payload accepted
        run.kv_handoff_s = max(
            handoff.call_time_s - handoff.queue_s - handoff.prefill_time_s + accept_s, 0.0
        )
        run.kv_bytes = int(handoff.kv_payload.nbytes)  # what passed through here
        path, moved = kv_path(handoff.kv_payload)
        self.events.kv_handoff(moved, run.kv_handoff_s, path)
        moved = run.num_input_tokens - handoff.kv_start  # decode took the rest from its cache
        self.cost_model.observe_handoff(moved, run.kv_handoff_s)

    def _prefill(self, run: RequestRun) -> Handoff | None:
        req = run.request
        if self.mode == COLOCATED or self.prefill_pool is None:
            run.served_by = COLOCATED
            return None
        n = len(req.prompt_ids)
        cached = {DECODE: 0, PREFILL: 0}
        if self.locality is not None and req.params.use_cache:
            cached = self.locality.cached(req.prompt_ids, req.params.cache_salt)
        if (place := getattr(self.decode_pool, "place", None)) is not None:  # remote/pools.py
            cached[DECODE] = place(req.request_id, req.prompt_ids, req.params)
        load = self.load.snapshot()
        run.decode_beside = load.decode_active
        if self.mode == CONDITIONAL:
            decision = self.cost_model.decide(
                n, load, cached_local=cached[DECODE], cached_remote=cached[PREFILL]
            )
            self.events.decision(decision.remote, decision.reason, self.cost_model.estimates())
            log.debug("request %s: %s", req.request_id, decision.explain())
            if not decision.remote:
                run.served_by = COLOCATED
                return None
        start, sent_wall = time.perf_counter(), time.time()
        skip = skip_tokens(cached[DECODE], n, self.engine_config.block_size)
        self.load.add_prefill(n)
        try:
            handoff = self.prefill_pool.prefill(req.request_id, req.prompt_ids, req.params, skip)
        except PoolError as e:
            if not run.is_cancelled():  # (stopped because its client left: not a pool failure)
                log.warning(
                    "request %s: prefill pool failed (%s); decode prefills it", req.request_id, e
                )
                self.events.error("prefill", "pool")
            run.served_by = FALLBACK
            return None
        finally:
            self.load.add_prefill(-n)
        queue_s = max(handoff.start_wall_s - sent_wall, 0.0) if handoff.start_wall_s else 0.0
        handoff = dataclasses.replace(
            handoff, call_time_s=time.perf_counter() - start, queue_s=queue_s
        )
        self.events.prefill(queue_s, handoff.prefill_time_s)
        # (what it computed: its prefix cache gave the rest)
        self.cost_model.observe_prefill(n - handoff.num_cached_tokens, handoff.prefill_time_s)
        run.served_by = DISAGGREGATED
        run.prefill_pid = handoff.worker_pid
        run.num_cached_tokens = handoff.num_cached_tokens
        return handoff

    def _add_tokens(
        self, run: RequestRun, tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> None:
        """The text of `tokens` (EOS aside) and, when asked for, their logprobs: every token
        up to the one that completes a stop string (as vLLM's, the tokens of the stop string
        itself included, though its text is cut)."""
        delta = ""
        for i, t in enumerate(tokens):
            run.token_ids.append(t)
            if t not in self.eos or run.request.params.ignore_eos:
                stopped = run.text.stopped
                delta += run.text.push(t)
                if run.logprobs is not None and logprobs and not stopped:
                    run.logprobs.append(logprob_object(self.tokenizer, t, logprobs[i]))
        if run.request.stream and (delta or run.has_unsent):
            run.emit(run.delta(delta))
