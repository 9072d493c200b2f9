"""Replay a workload through a topology in simulated time: per-request timelines, as the
benchmark client would have recorded them, so bench/stats.py and bench/report.py summarise
a prediction exactly as they summarise a measurement.

What runs for real here, on a simulated clock: the decode engines' `Scheduler` and
`BlockManager` (admission, slots, KV budget, stops), `DecodeService`'s delivery (the stream
interval), the conditional mode's `CostModel` and `LoadTracker` (deciding, and learning
from what it observes, as in the orchestrator), and the frontend's replica choice
(`remote/replicas.py` ReplicaSet, least loaded by reported load). What is mirrored: the
decode step (planner/decode_sim.py, pinned by a test) and the orchestrator's flow below
(MIRROR of pipeline/orchestrator.py `Orchestrator.run`, `_prefill`, `_decode_steps`,
`_token_times`: which pool prefills, when the load tracker counts, what the cost model is
told), without its text handling, fallback, migration and cancels, none of which a healthy
benchmark run exercises.

Time of one disaggregated request: arrival -> dispatch_s -> prefill queue -> prefill + pack
(prefill node) -> return_s: first token -> hand-off (profile.handoff by path) -> decode
queue -> admitted with its K/V (kv_write inside a step) -> a token per step, each response
return_s later at the client. Co-located: arrival -> dispatch_s -> decode queue -> whole or
chunked prefill inside decode steps -> tokens.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from disagg.bench.stats import Timeline
from disagg.bench.workloads import RequestSpec
from disagg.contracts import COLOCATED, CONDITIONAL, DISAGGREGATED, error_kind_of
from disagg.engine.sequence import SamplingParams, TokenLogprob
from disagg.errors import DisaggError
from disagg.pipeline.conditional import CostModel, CostParams, LoadTracker, LocalPrefill
from disagg.planner.clock import EventLoop, Node
from disagg.planner.decode_sim import SimHandoff
from disagg.planner.pools import SimDecodeReplica, SimPrefillReplica
from disagg.planner.profile import NETWORK, SHM, Profile
from disagg.planner.topology import LEAST_LOADED, Topology
from disagg.remote.replicas import ReplicaSet

R = TypeVar("R")


class Router(Generic[R]):
    """Which replica of a pool takes the next request: least loaded (the real ReplicaSet on
    the simulated clock, fed the decode servers' load reports) or in turn."""

    def __init__(self, kind: str, replicas: list[R], policy: str, clock: Callable[[], float]):
        self.replicas = replicas
        self._addresses = [f"{kind}-{i}:{8001 + i}" for i in range(len(replicas))]
        self._set = ReplicaSet(",".join(self._addresses), probe=lambda _: True, clock=clock)
        self._by_address = {r.address: r for r in self._set.replicas}
        self._turn = itertools.cycle(range(len(replicas)))
        self.least_loaded = policy == LEAST_LOADED

    def choose(self) -> tuple[R, Callable[[], None]]:
        """A replica, and the call that says its request is done."""
        if self.least_loaded:
            chosen = self._set.choose()
            assert chosen is not None  # (every simulated replica is always healthy)
            index = self._addresses.index(chosen.address)
        else:
            index = next(self._turn)
            chosen = self._by_address[self._addresses[index]]
        using = self._set.using(chosen)
        using.__enter__()

        def release() -> None:
            using.__exit__(None, None, None)

        return self.replicas[index], release

    def report(self, index: int, running: int, waiting: int, free: int, free_kv: int) -> None:
        self._set.report(self._by_address[self._addresses[index]], running, waiting, free, free_kv)


@dataclass(eq=False)
class _Run:
    """One request's state in the simulated frontend (the real one: pipeline/request.py
    RequestRun)."""

    spec: RequestSpec
    timeline: Timeline
    served_by: str = ""
    handoff: SimHandoff | None = None
    sent_s: float = 0.0  # handed to decode
    decode_beside: int = 0  # sequences decoding when it was (RequestRun.decode_beside)
    last_token_s: float | None = None
    release: Callable[[], None] = lambda: None  # its decode replica's outstanding count
    local: LocalPrefill | None = None  # prefilled by decode: waiting for its first token
    done: Callable[[], None] = lambda: None


class _Sink:
    """Where a decode replica's responses for one request go (decode_service.Sink)."""

    def __init__(self, sim: Simulator, run: _Run, replica: SimDecodeReplica) -> None:
        self.sim, self.run, self.replica = sim, run, replica

    def send(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        num_cached_tokens: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        if not token_ids and finish_reason is None:
            return  # decode's acknowledgement
        self.replica.num_sends += 1
        tokens = len(token_ids)
        self.sim.loop.after(
            self.sim.profile.overheads.return_s,
            lambda: self.sim._received(self.run, tokens, finish_reason),
        )

    def fail(self, error: Exception) -> None:  # a simulated engine does not die
        raise AssertionError(f"simulated decode failed: {error}")

    def is_cancelled(self) -> bool:
        return False


def cost_model_for(topology: Topology) -> CostModel:
    """The conditional mode's cost model as the orchestrator model builds it (prefill
    instances: the prefill replicas, which a deployment sets prefill_instances to)."""
    return CostModel(
        CostParams(
            remote_stall=topology.stall_prior, prefill_instances=max(topology.num_prefill, 1)
        )
    )


@dataclass
class SimResult:
    timelines: list[Timeline]
    counts: dict[str, float] = field(default_factory=dict)  # as bench's server counts
    utilisation: dict[str, float] = field(default_factory=dict)  # node -> busy share
    duration_s: float = 0.0


class Simulator:
    """One run of a topology (fresh pools; `cost_model` may carry over between runs, as the
    real orchestrator's does between a sweep's rates)."""

    def __init__(
        self, profile: Profile, topology: Topology, cost_model: CostModel | None = None
    ) -> None:
        self.profile, self.topology = profile, topology
        self.loop = EventLoop()
        self.cost_model = cost_model or cost_model_for(topology)
        self.load = LoadTracker()
        self.counts: Counter[str] = Counter()
        t = topology
        contention = profile.overheads.contention if t.contention is None else t.contention
        shared = Node(self.loop, "server", contention) if t.shared else None
        self.nodes = [shared] if shared else []

        def node(name: str) -> Node:
            if shared is not None:
                return shared
            self.nodes.append(Node(self.loop, name, contention))
            return self.nodes[-1]

        prefill = [
            SimPrefillReplica(self.loop, node(f"prefill-{i}"), profile)
            for i in range(t.num_prefill)
        ]
        decode = [
            SimDecodeReplica(self.loop, node(f"decode-{i}"), profile, t, self._reported)
            for i in range(t.num_decode)
        ]
        clock = lambda: self.loop.now  # noqa: E731
        self.prefill = Router("prefill", prefill, t.router, clock)
        self.decode = Router("decode", decode, t.router, clock)
        self.handoff_path = SHM if t.shared else NETWORK

    # ---------------------------------------------------------------- driving it

    def run(self, specs: list[RequestSpec]) -> SimResult:
        """Open loop: each request at its arrival time."""
        runs = [self._new_run(s) for s in specs]
        for r in runs:
            self.loop.at(r.spec.arrival_s, lambda r=r: self._arrive(r))  # type: ignore[misc]
        self.loop.run()
        return self._result(runs)

    def run_one_at_a_time(self, specs: list[RequestSpec]) -> SimResult:
        """Each request sent when the one before it has finished (bench's unloaded calibration)."""
        runs = [self._new_run(s) for s in specs]
        for r, nxt in zip(runs, runs[1:], strict=False):
            r.done = lambda nxt=nxt: self._arrive(nxt)  # type: ignore[misc]
        if runs:
            self.loop.at(0.0, lambda: self._arrive(runs[0]))
        self.loop.run()
        return self._result(runs)

    def _new_run(self, spec: RequestSpec) -> _Run:
        return _Run(spec, Timeline(spec.cls, send_s=0.0, prompt_tokens=spec.prompt_tokens))

    def _result(self, runs: list[_Run]) -> SimResult:
        end = self.loop.now
        busy = {n.name: (n.busy_s / end if end else 0.0) for n in self.nodes}
        return SimResult([r.timeline for r in runs], dict(self.counts), busy, end)

    def _reported(self, replica: SimDecodeReplica) -> None:
        self.decode.report(self.decode.replicas.index(replica), *replica.load)

    # ---------------------------------------------------------------- the frontend (MIRROR)

    def _arrive(self, run: _Run) -> None:
        run.timeline.send_s = self.loop.now
        spec, limit = run.spec, self.topology.max_model_len
        if spec.prompt_tokens + spec.max_tokens > limit:  # Orchestrator.check_request
            run.timeline.error = f"invalid_request: prompt + max_tokens exceeds {limit} tokens"
            run.timeline.end_s = self.loop.now
            run.done()
            return
        self.loop.after(self.profile.overheads.dispatch_s, lambda: self._prefill(run))

    def _prefill(self, run: _Run) -> None:
        n, mode = run.spec.prompt_tokens, self.topology.mode
        load = self.load.snapshot()
        run.decode_beside = load.decode_active
        if mode == CONDITIONAL:
            d = self.cost_model.decide(n, load)
            self.counts[f"{'remote' if d.remote else 'local'}:{d.reason}"] += 1
            if not d.remote:
                mode = COLOCATED
        if mode == COLOCATED:
            run.served_by = COLOCATED
            self._start_decode(run)
            return
        self.load.add_prefill(n)
        replica, release = self.prefill.choose()

        def prefilled(start_s: float, compute_s: float) -> None:
            self.loop.after(
                self.profile.overheads.return_s,
                lambda: self._prefill_returned(run, release, compute_s),
            )

        replica.submit(n, prefilled)

    def _prefill_returned(self, run: _Run, release: Callable[[], None], compute_s: float) -> None:
        n = run.spec.prompt_tokens
        release()
        self.load.add_prefill(-n)
        self.cost_model.observe_prefill(n, compute_s)
        run.served_by, run.handoff = DISAGGREGATED, SimHandoff(n)
        self._token_times(run, 1)  # the first token goes out at once
        handoff_s = self.profile.handoff_s(self.handoff_path, n)
        self.loop.after(handoff_s, lambda: self._start_decode(run, handoff_s))

    def _start_decode(self, run: _Run, handoff_s: float | None = None) -> None:
        self.counts[f"served_by={run.served_by}"] += 1
        self.load.add_decode(1)
        spec = run.spec
        replica, run.release = self.decode.choose()
        run.sent_s = self.loop.now
        if run.handoff is None:  # (the orchestrator's Q_local)
            run.local = self.load.local_prefill(spec.prompt_tokens)
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
        try:
            replica.submit(
                f"sim-{spec.index}", params, _Sink(self, run, replica), run.handoff,
                spec.prompt_tokens,
            )  # fmt: skip
        except DisaggError as e:  # refused: too long for the engine, or its queue is full
            run.timeline.error = f"{error_kind_of(e)}: {e}"
            self._finish(run)
            return
        if handoff_s is not None:
            self.cost_model.observe_handoff(spec.prompt_tokens, handoff_s)

    def _received(self, run: _Run, num_tokens: int, finish_reason: str | None) -> None:
        if num_tokens and run.handoff is None and run.last_token_s is None:
            ahead = run.local.ahead if run.local else 0
            self.cost_model.observe_local_prefill(
                run.spec.prompt_tokens, self.loop.now - run.sent_s, run.decode_beside, ahead
            )
        if num_tokens and run.local is not None:
            run.local.done()
        if num_tokens:
            self._token_times(run, num_tokens)
        if finish_reason is not None:
            self._finish(run)

    def _token_times(self, run: _Run, num_tokens: int) -> None:
        now, t = self.loop.now, run.timeline
        t.chunk_s.append(now)
        t.chunk_tokens.append(num_tokens)
        t.output_tokens += num_tokens
        if run.last_token_s is None:
            num_tokens, gap = num_tokens - 1, 0.0
        else:
            gap = (now - run.last_token_s) / max(num_tokens, 1)
        if num_tokens > 0 and gap > 0:
            self.cost_model.observe_gap(gap, self.load.snapshot().prefill_queue_tokens > 0)
        run.last_token_s = now

    def _finish(self, run: _Run) -> None:
        run.timeline.end_s = self.loop.now
        run.release()
        if run.local is not None:
            run.local.done()
        self.load.add_decode(-1)
        run.done()
