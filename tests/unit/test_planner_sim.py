"""The simulator from plain numbers: a hand-made profile (tests/helpers/profiles.py), hand-
computed timelines for one request, a batch and a queue, and the directions the modes must
differ in."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.profiles import simple_profile, smollm_like_profile

from disagg.bench import workloads as W
from disagg.bench.stats import summarize
from disagg.planner.clock import EventLoop, Node
from disagg.planner.simulator import Simulator
from disagg.planner.topology import Topology

pytestmark = pytest.mark.unit
P = simple_profile()  # prefill 1 ms/token, decode 9 ms + 1 ms/row, see its docstring
DISPATCH, RETURN, SEND = 0.005, 0.001, 0.0001


def spec(i: int, prompt: int, output: int, at: float = 0.0, cls: str = "c") -> W.RequestSpec:
    return W.RequestSpec(i, cls, at, prompt, output, {})


def run(topology: str, specs: list[W.RequestSpec], **options: object):
    return Simulator(P, Topology.parse(topology, **options)).run(specs)


def test_one_disaggregated_request_alone_is_dispatch_prefill_pack_and_the_way_back():
    (t,) = run("disaggregated:1p1d", [spec(0, 100, 5)]).timelines
    ttft = DISPATCH + 0.100 + 0.002 + RETURN  # prefill 100 tokens, pack, response
    assert t.ttft == pytest.approx(ttft)
    # the network hand-off (3 ms), then decode's first step writes the K/V (0.5 ms) and
    # decodes (10 ms); every later token costs a step and the send before it (0.1 ms)
    first_decoded = ttft + 0.003 + 0.0005 + 0.010 + RETURN
    expected = [ttft, first_decoded] + [first_decoded + k * (0.010 + SEND) for k in (1, 2, 3)]
    assert t.chunk_s == pytest.approx(expected)
    assert t.output_tokens == 5 and t.end_s == pytest.approx(expected[-1])
    assert t.tpot == pytest.approx((expected[-1] - ttft) / 4)


def test_one_colocated_request_gets_its_first_two_tokens_from_one_step():
    """A short prompt decode prefills whole is decoded in the same step (as DecodeEngine
    does), so its first response carries two tokens."""
    (t,) = run("colocated:1d", [spec(0, 40, 3)]).timelines
    step1 = 0.040 + 0.0005 + 0.010  # prefill 40, write its K/V, decode one row
    assert t.chunk_s == pytest.approx(
        [DISPATCH + step1 + RETURN, DISPATCH + step1 + SEND + 0.010 + RETURN]
    )
    assert t.chunk_tokens == [2, 1]


def steady_gap(batch: int) -> list[float]:
    """Token gaps of the last of `batch` requests arriving together, once all decode (the
    first one's arrival starts a step alone, as the real loop wakes on the first submit)."""
    result = run("colocated:1d", [spec(i, 10, 20) for i in range(batch)], stream_interval=1)
    t = result.timelines[-1]
    return list(np.diff(t.chunk_s)[1:15])


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_batching_raises_the_token_gap_as_the_profile_says(batch):
    step = P.decode(batch, 0) + batch * SEND  # a decode step, then one send per sequence
    assert steady_gap(batch) == pytest.approx([step] * 14)


@pytest.mark.parametrize("batch", [1, 8])
def test_a_step_overhead_is_paid_once_a_step_and_a_send_once_a_sequence(batch):
    """overheads.step_s (what calibration on served runs fills) costs once per step
    whatever the batch; send_s once per response: at 8 rows the two differ 8x."""
    profile = P.with_overheads(step_s=0.004)
    result = Simulator(profile, Topology.parse("colocated:1d", stream_interval=1)).run(
        [spec(i, 10, 20) for i in range(batch)]
    )
    gaps = list(np.diff(result.timelines[-1].chunk_s)[1:15])
    assert gaps == pytest.approx([P.decode(batch, 0) + batch * SEND + 0.004] * 14)


def test_overheads_without_a_step_cost_or_contention_read_as_before():
    from disagg.planner.profile import Overheads

    old = {"dispatch_s": 0.005, "return_s": 0.001, "send_s": 0.0001, "source": "older file"}
    assert Overheads.from_json(old).step_s == 0.0
    assert Overheads.from_json(old).contention == 1.0  # fair sharing, as before the field
    again = Overheads.from_json(Overheads(0.005, 0.001, 0.0001, 0.004, 1.5, "x").to_json())
    assert (again.step_s, again.contention, again.source) == (0.004, 1.5, "x")


def test_a_bigger_batch_decodes_each_sequence_slower():
    assert steady_gap(8)[0] > steady_gap(4)[0] > steady_gap(1)[0]


def test_a_second_prompt_queues_behind_the_first_at_the_prefill_server():
    a, b = run("disaggregated:1p1d", [spec(0, 100, 2), spec(1, 100, 2)]).timelines
    assert b.ttft == pytest.approx(a.ttft + 0.100 + 0.002)
    a2, b2 = run("disaggregated:2p1d", [spec(0, 100, 2), spec(1, 100, 2)]).timelines
    assert b2.ttft == pytest.approx(a2.ttft)  # two prefill servers: no queue


def test_the_stream_interval_batches_tokens_once_over_half_the_slots_decode():
    specs = [spec(i, 10, 9) for i in range(3)]
    fine = run("colocated:1d", specs, max_num_seqs=4, stream_interval=1).timelines
    coarse = run("colocated:1d", specs, max_num_seqs=4, stream_interval=2).timelines
    assert all(set(t.chunk_tokens) == {1, 2} and t.chunk_tokens[0] == 2 for t in fine)
    assert all(max(t.chunk_tokens) == 2 and len(t.chunk_tokens) < len(f.chunk_tokens)
               for t, f in zip(coarse, fine, strict=True))  # fmt: skip
    assert [t.output_tokens for t in coarse] == [9, 9, 9]


def test_disaggregation_keeps_short_requests_decoding_smoothly_beside_long_prompts():
    """Equal nodes, the interference workload: co-located decode prefills 2000-token prompts
    in chunks inside its steps, so short requests' token gaps stretch; a decode node that
    never prefills keeps them flat; but the one prefill node queues short prompts behind
    the long ones, where co-located decode prefills a short prompt at its next step."""
    specs = W.build(W.WORKLOADS["interference"], 0.3, 80, seed=1)
    profile = smollm_like_profile()
    co = Simulator(profile, Topology.parse("colocated:2d")).run(specs).timelines
    dis = Simulator(profile, Topology.parse("disaggregated:1p1d")).run(specs).timelines
    co_short, dis_short = summarize(co, "short"), summarize(dis, "short")
    assert dis_short.itl.p99 < co_short.itl.p99
    assert dis_short.tpot.p99 < co_short.tpot.p99
    # and the price: short prompts queue behind long ones at the one prefill node
    assert dis_short.ttft.p90 > co_short.ttft.p90


def test_pools_sharing_cores_slow_each_other():
    """A request decoding while another prompt is prefilled: on separate nodes its steps
    keep their pace, on one server's shared cores they slow down."""
    specs = [spec(0, 10, 60), spec(1, 800, 2, at=0.2)]
    apart = Simulator(P, Topology.parse("disaggregated:1p1d")).run(specs).timelines[0]
    shared = Simulator(P, Topology.parse("disaggregated:1p1d@shared")).run(specs).timelines[0]
    assert shared.tpot > apart.tpot * 1.1


def test_the_conditional_mode_decides_with_the_real_cost_model_and_learns():
    specs = [spec(0, 20, 200), spec(1, 1500, 2, at=0.3)]
    sim = Simulator(P, Topology.parse("conditional:1p1d"))
    result = sim.run(specs)
    # alone, the first is prefilled locally; the long prompt beside it goes remote
    assert result.counts["local:decode_idle"] == 1 and result.counts["remote:protect_decode"] == 1
    assert result.counts["served_by=colocated"] == result.counts["served_by=disaggregated"] == 1
    prior = 1.5e-3  # CostParams.prefill_s_per_token; the profile's is 1e-3
    assert abs(sim.cost_model.remote_s_per_token - 1e-3) < abs(prior - 1e-3)


@pytest.mark.parametrize("router", ["least_loaded", "round_robin"])
def test_the_router_spreads_requests_over_decode_replicas(router):
    result = run("colocated:2d", [spec(0, 30, 20), spec(1, 30, 20)], router=router)
    assert all(u > 0 for u in result.utilisation.values()) and len(result.utilisation) == 2
    (a, b) = result.timelines
    assert a.ttft == pytest.approx(b.ttft)  # neither waited for the other


def test_refused_requests_become_errors_of_their_kind():
    too_long = run("colocated:1d", [spec(0, 2000, 100)]).timelines[0]
    assert too_long.error.startswith("invalid_request") and not too_long.ok
    crowd = run("colocated:1d", [spec(i, 10, 50) for i in range(4)], max_num_seqs=1, max_queue=1)
    errors = [t.error.split(":")[0] for t in crowd.timelines if t.error]
    assert errors == ["unavailable", "unavailable"]  # one runs, one waits, two are refused


def test_nodes_share_their_time_between_jobs():
    loop = EventLoop()
    fair, free = Node(loop, "fair", 1.0), Node(loop, "free", 0.0)
    done: dict[str, float] = {}
    fair.run(1.0, lambda e: done.setdefault("a", loop.now))
    loop.at(0.5, lambda: fair.run(1.0, lambda e: done.setdefault("b", loop.now)))
    free.run(1.0, lambda e: done.setdefault("c", loop.now))
    free.run(1.0, lambda e: done.setdefault("d", loop.now))
    loop.run()
    # a runs alone for 0.5 s, then at half speed beside b: done at 1.5; b's last 0.5 alone
    assert done["a"] == pytest.approx(1.5) and done["b"] == pytest.approx(2.0)
    assert done["c"] == done["d"] == pytest.approx(1.0)
    assert fair.busy_s == pytest.approx(2.0)
