"""The simulated pools: prefill replicas (a FIFO queue in front of one engine instance) and
decode replicas (the real `DecodeService` delivery over a `SimDecodeEngine`), each running
its work on a `Node` in simulated time."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from disagg.engine.sequence import SamplingParams
from disagg.pipeline.decode_service import DecodeService, Sink
from disagg.planner.clock import EventLoop, Node
from disagg.planner.decode_sim import SimDecodeEngine, SimHandoff, SimTokenOutput, StepWork
from disagg.planner.profile import Profile
from disagg.planner.topology import Topology

if TYPE_CHECKING:
    from disagg.engine.llm_engine import DecodeEngine, PrefillResult, TokenOutput


class SimPrefillReplica:
    """One prefill server (one instance): prompts wait in arrival order, then each takes
    profile.prefill (compute, first token) and profile.pack (the payload) on its node, as
    the prefill model packs before it answers."""

    def __init__(self, loop: EventLoop, node: Node, profile: Profile) -> None:
        self.loop, self.node, self.profile = loop, node, profile
        self._queue: deque[tuple[int, Callable[[float, float], None]]] = deque()
        self._busy = False
        self.queued_tokens = 0

    def submit(self, num_tokens: int, done: Callable[[float, float], None]) -> None:
        """`done(start_s, compute_s)` once the prompt is prefilled and packed."""
        self._queue.append((num_tokens, done))
        self.queued_tokens += num_tokens
        if not self._busy:
            self._next()

    def _next(self) -> None:
        if not self._queue:
            self._busy = False
            return
        self._busy = True
        n, done = self._queue.popleft()
        start = self.loop.now
        pack_s = self.profile.pack(self.profile.payload_bytes(n))

        def packed(_: float, compute_s: float) -> None:
            self.queued_tokens -= n
            done(start, compute_s)
            self._next()

        self.node.run(
            self.profile.prefill(n),
            lambda compute_s: self.node.run(pack_s, lambda e: packed(e, compute_s)),
        )


class SimDecodeReplica:
    """One decode server: the engine loop steps while it has sequences, each step's work
    timed by the profile; outputs go out through the real DecodeService._deliver (the
    stream interval: several tokens per response while over half the slots decode), then
    each response sent costs decode overheads.send_s and the step overheads.step_s before
    the next step."""

    def __init__(
        self,
        loop: EventLoop,
        node: Node,
        profile: Profile,
        topology: Topology,
        on_step: Callable[[SimDecodeReplica], None] = lambda r: None,
    ) -> None:
        self.loop, self.node, self.profile = loop, node, profile
        self.engine = SimDecodeEngine(topology.engine_config())
        # the real delivery: its engine is ours (what it calls: add_request, has_unfinished,
        # finish_request on a failed send, which a simulated sink never has)
        self.service = DecodeService(
            cast("DecodeEngine", self.engine),
            stream_interval=topology.stream_interval,
            batch_slots=topology.max_num_seqs,
        )
        self.on_step = on_step
        self._stepping = False
        self.num_sends = 0  # responses sent in the step being delivered
        self.steps: list[tuple[float, StepWork]] = []  # (start, work): for tests and traces
        self.keep_steps = False

    def submit(
        self, request_id: str, params: SamplingParams, sink: Sink, handoff: SimHandoff | None,
        num_prompt_tokens: int,
    ) -> None:  # fmt: skip
        """Raises RequestError / CapacityError as the real decode pool does."""
        prompt = None if handoff is not None else [0] * num_prompt_tokens
        self.service.submit(
            request_id, params, sink, prefill=cast("PrefillResult | None", handoff),
            prompt_ids=prompt,
        )  # fmt: skip
        if not self._stepping:
            self._stepping = True
            self._step()

    @property
    def load(self) -> tuple[int, int, int, int]:
        """(running, waiting, free slots, free KV tokens): what a decode server reports."""
        s = self.engine.scheduler
        free_kv = s.block_manager.num_free_blocks * s.block_manager.block_size
        return len(s.running), len(s.waiting), s.config.max_num_seqs - len(s.running), free_kv

    def _step(self) -> None:
        if not self.engine.has_unfinished:
            self._stepping = False
            return
        start = self.loop.now
        work, outputs = self.engine.step()
        if self.keep_steps:
            self.steps.append((start, work))
        self.node.run(work.seconds(self.profile), lambda _: self._delivered(outputs))

    def _delivered(self, outputs: list[SimTokenOutput]) -> None:
        self.num_sends = 0
        running = len(self.engine.scheduler.running)
        self.service._deliver(cast("list[TokenOutput]", outputs), running)
        self.on_step(self)
        o = self.profile.overheads
        send_s = self.num_sends * o.send_s + o.step_s
        if send_s > 0:
            self.node.run(send_s, lambda _: self._step())
        else:
            self._step()
