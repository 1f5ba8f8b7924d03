"""The scaling model: network costs, placement, pipeline step, costs files and the CLI."""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyparflow.engine.schedule import theoretical_bubble
from hyparflow.simulate import (
    Affine,
    EngineCosts,
    LayerCost,
    Layout,
    Link,
    Machine,
    ModelCosts,
    Network,
    Placement,
    predict,
)
from hyparflow.simulate.netbench import fit_network
from hyparflow.simulate.network import (
    allreduce,
    bucketed_allreduce,
    rabenseifner_allreduce,
    recursive_doubling_allreduce,
    ring_allreduce,
)

FAST = Link(0.0, 1e30)  # a network that costs nothing


def uniform_costs(layers=8, forward=1e-4, backward=2e-4, param_bytes=4000, cut_bytes=1000.0):
    """`layers` identical layers, seconds per sample forward and backward, no engine costs."""
    return ModelCosts(
        name="uniform",
        layers=[
            LayerCost(f"l{i}", Affine(0.0, forward), Affine(0.0, backward), param_bytes, 2)
            for i in range(layers)
        ],
        cut_bytes=[0.0] + [cut_bytes] * (layers - 1) + [0.0],
    )


@pytest.mark.parametrize("name", ["network", "placement", "costs", "sharing", "netbench"])
def test_docstring_examples_hold(name):
    import doctest
    import importlib

    module = importlib.import_module(f"hyparflow.simulate.{name}")
    assert doctest.testmod(module).failed == 0


# --- network ------------------------------------------------------------------------------


def test_point_to_point_is_latency_plus_bytes_over_bandwidth():
    assert Link(2e-6, 10e9).time(0) == 2e-6
    assert Link(2e-6, 10e9).time(10e9) == pytest.approx(1.0 + 2e-6)
    net = Network(intra=Link(1e-6, 20e9), inter=Link(5e-6, 10e9))
    assert net.p2p(1e6, crosses_nodes=False) == pytest.approx(1e-6 + 1e6 / 20e9)
    assert net.p2p(1e6, crosses_nodes=True) == pytest.approx(5e-6 + 1e6 / 10e9)


def test_allreduce_algorithms_on_known_cases():
    link = Link(1e-6, 1e9)
    # p = 4, 8 MB: ring 2(p-1) alpha + 2 (p-1)/p n / beta, plus (p-1)/p n / rate
    assert ring_allreduce(8e6, 4, link) == pytest.approx(6e-6 + 0.012)
    assert ring_allreduce(8e6, 4, link, reduce_rate=6e9) == pytest.approx(6e-6 + 0.012 + 0.001)
    assert rabenseifner_allreduce(8e6, 4, link) == pytest.approx(4e-6 + 0.012)
    assert recursive_doubling_allreduce(8e6, 4, link) == pytest.approx(2 * (1e-6 + 0.008))
    # non-power-of-two rounds up the log
    assert recursive_doubling_allreduce(8, 5, link) == pytest.approx(3 * (1e-6 + 8e-9))
    for f in (ring_allreduce, rabenseifner_allreduce, recursive_doubling_allreduce):
        assert f(1e9, 1, link) == 0.0
    assert allreduce(8, 64, link)[1] == "recursive doubling"
    assert allreduce(64e6, 64, link)[1] == "rabenseifner"
    assert allreduce(64e6, 64, Link(0.0, 1e9))[0] == pytest.approx(2 * 63 / 64 * 0.064)


def test_buckets_add_their_latencies():
    link = Link(1e-3, 1e12)
    one = bucketed_allreduce(100e6, 2, link, bucket_bytes=200e6)
    four = bucketed_allreduce(100e6, 2, link, bucket_bytes=25e6)
    assert four - one == pytest.approx(3 * 1e-3)  # three more latencies, same bytes
    assert bucketed_allreduce(0, 8, link) == 0.0


@settings(max_examples=60, deadline=None)
@given(
    nbytes=st.floats(1, 1e9),
    ranks=st.integers(1, 4096),
    bandwidth=st.floats(1e6, 1e11),
    factor=st.floats(1.0, 100.0),
)
def test_more_bandwidth_or_less_latency_is_never_slower(nbytes, ranks, bandwidth, factor):
    slow, fast = Link(5e-6, bandwidth), Link(5e-6, bandwidth * factor)
    assert allreduce(nbytes, ranks, fast)[0] <= allreduce(nbytes, ranks, slow)[0] * (1 + 1e-12)
    near = Link(1e-6, bandwidth)
    far = Link(1e-6 * factor, bandwidth)
    assert allreduce(nbytes, ranks, near)[0] <= allreduce(nbytes, ranks, far)[0] * (1 + 1e-12)


def test_shared_link_splits_bandwidth_only():
    assert Link(1e-6, 12e9).shared(4) == Link(1e-6, 3e9)
    assert Link(1e-6, 12e9).shared(0) == Link(1e-6, 12e9)


def test_network_file_round_trip():
    net = Network(Link(1e-6, 9e9), Link(2e-6, 12e9), reduce_rate=5e9, overhead=1e-5,
                  handoff=2e-5, handoff_bandwidth=3e9, oversubscribed_latency=1e-6,
                  oversubscribed_collective_latency=3e-4, oversubscribed_wakeup=2e-3,
                  per_tensor=4e-5, loop_first=3e-4, loop_last=6e-4,
                  loop_unpartitioned=5e-4)  # fmt: skip
    assert Network.from_dict(json.loads(json.dumps(net.to_dict()))) == net
    alone = Network(Link(1e-6, 9e9))
    assert Network.from_dict(json.loads(json.dumps(alone.to_dict()))) == alone
    with pytest.raises(ValueError, match="inter-node"):
        alone.link(crosses_nodes=True)


def test_network_fit_recovers_a_synthetic_machine():
    alpha, beta, rate, overhead, copy = 1e-6, 8e9, 4e9, 20e-6, 5e9
    pingpong = {n: alpha + n / beta for n in (8, 1024, 1 << 20, 4 << 20, 16 << 20)}
    allreduces = {n: 2 * alpha + n / beta + n / 2 / rate for n in (1 << 20, 4 << 20, 16 << 20)}
    per_tensor = 3e-5
    reducer = {(n, k): allreduces[n] + n / copy + k * per_tensor
               for n, k in ((1 << 20, 4), (1 << 20, 64), (16 << 20, 16))}  # fmt: skip
    handoff, handoff_bandwidth = 5e-5, 2e9

    def hop(nbytes):  # sends and handoffs seen at one boundary size
        wait = alpha + handoff + nbytes / handoff_bandwidth
        return {"send_s": [overhead, overhead / 2, 2 * overhead],
                "handoff_s": [wait - 1e-5, wait, wait + 2e-5]}  # fmt: skip

    hops = {4096: hop(4096), 1 << 19: hop(1 << 19)}
    for h in hops.values():  # the loop's work per step on each stage, and unpartitioned
        h.update(loop_first_s=[3e-4, 4e-4, 9e-4], loop_last_s=[7e-4, 6e-4, 5e-3])
    fitted = fit_network(pingpong, allreduces, reducer, hops, 2, [5e-4, 4e-4, 6e-4, 1e-2])
    assert (fitted["loop_first"], fitted["loop_last"]) == (4e-4, 7e-4)  # medians
    assert fitted["loop_unpartitioned"] == pytest.approx(5.5e-4)
    assert fitted["intra"]["latency"] == pytest.approx(alpha, rel=0.01)
    assert fitted["intra"]["bandwidth"] == pytest.approx(beta, rel=1e-6)
    assert fitted["reduce_rate"] == pytest.approx(rate, rel=1e-3)
    assert fitted["overhead"] == pytest.approx(overhead, rel=1e-6)  # medians
    assert fitted["handoff"] == pytest.approx(handoff, rel=1e-3)
    assert fitted["handoff_bandwidth"] == pytest.approx(handoff_bandwidth, rel=1e-6)
    assert fitted["copy_rate"] == pytest.approx(copy, rel=1e-6)
    assert fitted["per_tensor"] == pytest.approx(per_tensor, rel=1e-6)


def test_collective_wait_recovers_a_scheduling_delay():
    from hyparflow.simulate.netbench import collective_wait
    from hyparflow.simulate.network import latency_steps

    network = Network(Link(1e-6, 10e9), reduce_rate=4e9, copy_rate=5e9, per_tensor=1e-5)
    wait = 4e-4
    crowded = Network(Link(1e-6, 10e9), reduce_rate=4e9, copy_rate=5e9, per_tensor=1e-5,
                      oversubscribed_collective_latency=wait)  # fmt: skip
    reducer = {n: crowded.gradient_allreduce(n, 4, False, 1, 2.0, tensors=16)
               for n in (1 << 20, 4 << 20, 16 << 20)}  # fmt: skip
    assert collective_wait(network.to_dict(), reducer, ranks=4, cores=2) == pytest.approx(wait)
    assert latency_steps("ring", 4) == 6 and latency_steps("recursive doubling", 5) == 3


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to")
def test_a_rank_that_computes_between_mpi_calls_holds_its_core_for_a_time_slice():
    from tests.mpirun import run_scenario

    # the netbench measurements behind `oversubscribed_latency` and `oversubscribed_wakeup`,
    # under a real mpirun: a message waits microseconds for its receiver beside a rank that
    # yields in MPI, and a scheduler tick (milliseconds here) beside one that computes on
    results = run_scenario("scheduling_waits", 4, timeout=120)
    yielding, holding = results[0]["yielding_one_way_s"], results[0]["holding_one_way_s"]
    assert 0 < yielding < 2e-4
    assert holding > 5 * yielding


# --- placement ----------------------------------------------------------------------------


def test_placement_follows_the_engine_grid():
    where = Placement(partitions=2, replicas=3, ranks_per_node=2)  # one pipeline per node
    assert where.nodes == 3
    assert not where.pipeline_link_crosses_nodes(0)
    assert where.stage_nodes(0) == where.stage_nodes(1) == 3
    assert where.offnode_reductions_per_node() == 2
    spread = Placement(partitions=4, replicas=1, ranks_per_node=2)
    assert [spread.pipeline_link_crosses_nodes(s) for s in range(3)] == [False, True, False]
    assert spread.stage_nodes(0) == 1 and spread.offnode_reductions_per_node() == 0
    assert Placement(3, 1, ranks_per_node=2).ranks_on_node(1) == 1


def test_links_are_chosen_by_placement():
    costs = uniform_costs(layers=4)
    net = Network(intra=Link(1e-6, 1e12), inter=Link(1e-6, 1e6))  # inter is very slow
    grads = costs.param_bytes / 2  # each of 2 stages owns half
    one_node = predict(costs, net, Layout(2, 2, 1, ranks_per_node=4), 64)
    assert one_node.allreduce_time == pytest.approx(net.gradient_allreduce(grads, 2, False))
    pipeline_per_node = predict(costs, net, Layout(2, 2, 1, ranks_per_node=2), 64)
    shared = net.gradient_allreduce(grads, 2, crosses_nodes=True, flows=2)
    assert pipeline_per_node.allreduce_time == pytest.approx(shared)
    assert shared == pytest.approx(net.gradient_allreduce(grads, 2, True) * 2, rel=1e-3)
    # a pipeline split over nodes pays the slow link between its stages
    split = predict(costs, net, Layout(2, 1, 1, ranks_per_node=1), 64, batch_logs=True)
    together = predict(costs, net, Layout(2, 1, 1, ranks_per_node=2), 64, batch_logs=True)
    wire = 2 * 1000.0 * 64 * (1 / 1e6 - 1 / 1e12)  # forward and backward message
    logs = net.logs_sync(2, 1, crosses_nodes=True) - net.logs_sync(2, 1, crosses_nodes=False)
    assert logs > 0  # the loop's agreement between steps crosses the slow link too
    assert split.step_time - together.step_time == pytest.approx(wire + logs, rel=1e-6)
    assert split.between_steps_time == pytest.approx(net.logs_sync(2, 1, True))


def test_steps_wait_for_the_last_stage_logs():
    costs = uniform_costs(layers=4)
    net = Network(intra=Link(1e-6, 1e12))
    layout = Layout(2, 2, 2)
    before = predict(costs, net, layout, 64, batch_logs=True)
    costs.engine = replace(costs.engine, step_fixed=0.25)  # a read-out longer than any step
    after = predict(costs, net, layout, 64, batch_logs=True)
    assert after.step_time > before.step_time + 0.2
    # callbacks that read no batch logs: the loop shares them once an epoch, not per step
    quiet = predict(costs, net, layout, 64)
    assert quiet.between_steps_time == 0.0
    assert quiet.step_time == pytest.approx(after.step_time - after.between_steps_time)
    assert after.between_steps_time == pytest.approx(
        after.step_time - after.pipeline_time - after.allreduce_time - after.optimizer_time
    )


# --- the step -----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    partitions=st.sampled_from([1, 2, 4, 8]),
    microbatches=st.integers(1, 12),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
)
def test_equal_stages_without_communication_follow_the_formula(partitions, microbatches, schedule):
    costs = uniform_costs(layers=8, forward=1e-4, backward=2e-4)
    batch = 8 * microbatches
    p = predict(costs, Network(FAST), Layout(partitions, 1, microbatches, schedule), batch)
    per_stage = (8 // partitions) * 8 * 3e-4  # layers x samples x (forward + backward)
    assert p.step_time == pytest.approx((microbatches + partitions - 1) * per_stage)
    assert p.bubble == pytest.approx(
        theoretical_bubble(partitions, microbatches) * (partitions > 1)
    )
    assert p.throughput == pytest.approx(batch / p.step_time)
    # the training loop's work before each step lengthens it, not the pipeline's bubble
    looping = Network(FAST, loop_first=per_stage, loop_last=per_stage / 2,
                      loop_unpartitioned=per_stage / 3)  # fmt: skip
    q = predict(costs, looping, Layout(partitions, 1, microbatches, schedule), batch)
    assert q.step_time > p.step_time
    assert q.bubble == pytest.approx(p.bubble)


def test_data_parallel_step_is_compute_plus_allreduce_plus_optimizer():
    costs = uniform_costs(layers=4)
    costs.engine = EngineCosts(optimizer_fixed=1e-3, optimizer_per_byte=1e-9)
    net = Network(intra=Link(1e-5, 1e9), reduce_rate=2e9, copy_rate=4e9, per_tensor=1e-4)
    p = predict(costs, net, Layout(1, 4), 256, batch_logs=True)
    compute = 4 * 64 * 3e-4
    copies = costs.param_bytes / 4e9 + costs.variables * 1e-4
    reduce = copies + allreduce(costs.param_bytes, 4, net.intra, 2e9)[0]
    assert p.allreduce_time == pytest.approx(reduce)
    logs = net.logs_sync(4, 4, crosses_nodes=False)  # metric sums, logs broadcast, stop vote
    assert p.between_steps_time == pytest.approx(logs)
    assert p.step_time == pytest.approx(compute + reduce + 1e-3 + 1e-9 * costs.param_bytes + logs)


def test_unpartitioned_model_runs_the_measured_fused_step_and_reduces_one_tensor():
    costs = uniform_costs(layers=4)
    costs.fused = Affine(1e-3, 1e-5)
    costs.engine = EngineCosts(forward_call=5e-3, backward_call=5e-3)  # not paid when fused
    net = Network(intra=Link(1e-5, 1e9), reduce_rate=2e9, copy_rate=4e9, per_tensor=1e-4)
    p = predict(costs, net, Layout(1, 4), 256)
    compute = 1e-3 + 1e-5 * 64  # one fused call on the rank's 64 samples
    reduce = allreduce(costs.param_bytes, 4, net.intra, 2e9)[0]  # in place: no copies
    assert p.pipeline_time == pytest.approx(compute)
    assert p.allreduce_time == pytest.approx(reduce)
    piped = predict(costs, net, Layout(2, 2), 256)  # stages still run forward + backward
    assert piped.stage_compute[0] > 5e-3


def test_engine_costs_land_where_the_engine_pays_them():
    costs = uniform_costs(layers=2)
    base = predict(costs, Network(FAST), Layout(2, 1, 4), 32).step_time
    costs.engine = EngineCosts(forward_call=1e-3)
    # 4 micro-batches through 2 stages: (m + p - 1) forward slots on the critical path
    with_calls = predict(costs, Network(FAST), Layout(2, 1, 4), 32).step_time
    assert with_calls - base == pytest.approx(5 * 1e-3)
    costs.engine = EngineCosts(accumulate_per_byte=1e-6)
    accumulating = predict(costs, Network(FAST), Layout(1, 1, 4), 32).step_time
    plain = predict(uniform_costs(2), Network(FAST), Layout(1, 1, 4), 32).step_time
    assert accumulating - plain == pytest.approx(3 * costs.param_bytes * 1e-6)  # 3 additions
    # the loop's work between steps: the first stage's delays the pipeline; the last stage's
    # hides while it waits for its first activations; an unpartitioned rank pays its own
    looping = Network(FAST, loop_first=1e-3, loop_last=1.5e-3, loop_unpartitioned=5e-4)
    costs.engine = EngineCosts()
    piped = predict(costs, looping, Layout(2, 1, 4), 32).step_time
    assert piped - base == pytest.approx(1e-3)
    replicated = predict(costs, looping, Layout(1, 2), 32).step_time
    assert replicated - predict(costs, Network(FAST), Layout(1, 2), 32).step_time == (
        pytest.approx(5e-4)
    )


@settings(max_examples=40, deadline=None)
@given(
    partitions=st.sampled_from([1, 2, 4]),
    replicas=st.sampled_from([1, 2, 8, 64]),
    per_node=st.sampled_from([1, 2, 4, 16]),
    bandwidth=st.floats(1e7, 1e11),
    factor=st.floats(1.0, 50.0),
)
def test_more_bandwidth_never_slows_a_step(partitions, replicas, per_node, bandwidth, factor):
    costs = uniform_costs(layers=8)
    layout = Layout(partitions, replicas, 4 if partitions > 1 else 1, ranks_per_node=per_node)
    batch = replicas * 4 * 8

    def step(beta):
        net = Network(intra=Link(1e-6, beta), inter=Link(3e-6, beta / 2), overhead=1e-6)
        return predict(costs, net, layout, batch).step_time

    assert step(bandwidth * factor) <= step(bandwidth) * (1 + 1e-9)


def test_sharing_cores_stretches_the_step():
    costs = uniform_costs(layers=4)
    net = Network(FAST)
    alone = predict(costs, net, Layout(1, 4), 64, Machine(cores_per_node=4))
    shared = predict(costs, net, Layout(1, 4), 64, Machine(cores_per_node=2))
    assert shared.slowdown == 2.0 and alone.slowdown == 1.0
    assert shared.step_time == pytest.approx(2 * alone.step_time)
    busy = predict(costs, net, Layout(1, 4), 64, Machine(cores_per_node=4, background=2.0))
    assert busy.step_time == pytest.approx(1.5 * alone.step_time)
    neighbours = predict(costs, net, Layout(1, 4), 64, Machine(cores_per_node=4, corun=1.2))
    assert neighbours.step_time == pytest.approx(1.2 * alone.step_time)
    single = predict(costs, net, Layout(1, 1), 16, Machine(cores_per_node=4, corun=1.2))
    assert single.slowdown == 1.0  # a rank alone on its node has no busy neighbours


@settings(max_examples=30, deadline=None)
@given(
    partitions=st.integers(1, 5),
    microbatches=st.integers(1, 8),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    seed=st.integers(0, 1000),
)
def test_shared_cores_run_the_ideal_schedule_when_they_suffice_or_stretch_it_when_spinning(
    partitions, microbatches, schedule, seed
):
    import random

    from hyparflow.engine.schedule import make_schedule, simulate
    from hyparflow.simulate.sharing import simulate_shared

    rng = random.Random(seed)
    forward = [rng.uniform(0.5, 2.0) for _ in range(partitions)]
    backward = [rng.uniform(1.0, 3.0) for _ in range(partitions)]
    setup = [rng.choice([0.0, rng.uniform(0.1, 3.0)]) for _ in range(partitions)]
    plan = make_schedule(schedule, partitions, microbatches)
    one_node = [{0: 1}] * partitions
    ideal = simulate(plan, forward, backward, 0.1, setup)
    roomy = simulate_shared(plan, forward, backward, 0.1, one_node, cores=partitions,
                            setup_work=setup, timeslice=1.5)  # fmt: skip
    assert roomy.makespan == pytest.approx(ideal.makespan)
    assert all(roomy.times[k] == pytest.approx(v) for k, v in ideal.times.items())
    assert roomy.busy == pytest.approx(ideal.busy)
    assert roomy.bubble == pytest.approx(ideal.bubble)
    # waiting ranks that spin take a full share: every rank runs partitions / cores slower
    spinning = simulate_shared(plan, forward, backward, 0.0, one_node, cores=1, idle_share=1.0)
    stretched = simulate(plan, [f * partitions for f in forward],
                         [b * partitions for b in backward])  # fmt: skip
    assert spinning.makespan == pytest.approx(stretched.makespan)
    yielding = simulate_shared(plan, forward, backward, 0.0, one_node, cores=1, idle_share=0.0)
    assert yielding.makespan <= spinning.makespan * (1 + 1e-9)


def test_waiting_ranks_take_their_idle_share_of_a_core():
    from hyparflow.engine.schedule import gpipe
    from hyparflow.simulate.sharing import simulate_shared

    # two stages on one core run one action at a time; the waiting one takes `share`
    for share in (0.0, 0.25, 1.0):
        sim = simulate_shared(gpipe(2, 1), [1.0, 2.0], [3.0, 4.0], 0.0, [{0: 1}, {0: 1}],
                              cores=1, idle_share=share)  # fmt: skip
        assert sim.makespan == pytest.approx(10.0 * (1 + share))
    # a stage whose replicas span two nodes runs at its busier node's pace
    crowded = simulate_shared(gpipe(1, 1), [1.0], [1.0], 0.0, [{0: 1, 1: 3}], cores=1)
    assert crowded.makespan == pytest.approx(2.0 * 3)
    busy = simulate_shared(gpipe(1, 1), [1.0], [1.0], 0.0, [{0: 1}], cores=2, background=3.0)
    assert busy.makespan == pytest.approx(2.0 * 2)
    # switching between computing ranks costs `timeslice`, only while they outnumber cores
    pair = [{0: 2}]
    switching = simulate_shared(gpipe(1, 1), [1.0], [1.0], 0.0, pair, cores=1, timeslice=1.25)
    assert switching.makespan == pytest.approx(2.0 * 2 * 1.25)
    roomy = simulate_shared(gpipe(1, 1), [1.0], [1.0], 0.0, pair, cores=2, timeslice=1.25)
    assert roomy.makespan == pytest.approx(2.0)
    # one stage computes while the other waits: no switching between computing ranks
    turns = simulate_shared(gpipe(2, 1), [1.0, 2.0], [3.0, 4.0], 0.0, [{0: 1}, {0: 1}],
                            cores=1, timeslice=1.25)  # fmt: skip
    assert turns.makespan == pytest.approx(10.0)
    # setup work shares the core like an action: two ranks' setups on one core, then F, B
    both = simulate_shared(gpipe(1, 1), [1.0], [1.0], 0.0, pair, cores=1, setup_work=[0.5])
    assert both.makespan == pytest.approx(2 * 0.5 + 2 * 2.0) and both.busy == [4.0]
    assert Placement(2, 3, ranks_per_node=4).stage_node_ranks() == [{0: 2, 1: 1}, {0: 2, 1: 1}]


def test_a_rank_woken_beside_a_computing_rank_waits_for_the_core_and_keeps_its_share():
    from hyparflow.engine.schedule import F, gpipe
    from hyparflow.simulate.sharing import simulate_shared, wake_wait

    # stages 0 and 2 share core 0, stage 1 has core 1. Stage 2's first input arrives at 2.5
    # while stage 0 still has 0.5 s of its second forward to run.
    apart = [{0: 1}, {1: 1}, {0: 1}]
    plan = gpipe(3, 2)
    args = (plan, [1.5, 1.0, 1.0], [1.0, 1.0, 1.0], 0.0, apart, 1)
    eager = simulate_shared(*args)
    assert eager.times[2, F(0)] == pytest.approx((2.5, 4.0))  # shares at once: 0.5 each
    woken = simulate_shared(*args, wakeup=1.0)
    wait = wake_wait(0.5, 1.0)  # the tick may come before that forward ends
    assert wait == pytest.approx(0.5 - 0.5**2 / 4)
    start = 2.5 + wait
    # meanwhile stage 0 still gets half the core (the waiting rank is owed its share), so
    # its forward ends when it would have; stage 2 runs what is left of it alone after
    assert woken.times[0, F(1)] == pytest.approx(eager.times[0, F(1)])
    shared = 3.5 - start
    assert woken.times[2, F(0)] == pytest.approx((start, 3.5 + 1.0 - shared / 2))
    # a message to a rank whose core-mates wait too is taken at once
    turns = simulate_shared(gpipe(2, 1), [1.0, 2.0], [3.0, 4.0], 0.0, [{0: 1}, {0: 1}], 1)
    alone = simulate_shared(gpipe(2, 1), [1.0, 2.0], [3.0, 4.0], 0.0, [{0: 1}, {0: 1}], 1,
                            wakeup=1.0)  # fmt: skip
    assert alone.times == turns.times
    # against a long action the wait is the measured mean; it never exceeds the action
    assert wake_wait(5.0, 1.0) == 1.0
    assert all(wake_wait(h, 1.0) <= h for h in (0.1, 0.5, 1.0, 1.9))


def test_pinned_ranks_short_of_cores_are_dealt_to_cores_in_rank_order():
    from hyparflow.engine.schedule import one_f_one_b
    from hyparflow.simulate.sharing import shared_pipeline, simulate_shared

    plan, forward, backward = one_f_one_b(4, 4), [1.0, 2.0, 1.5, 1.0], [2.0, 3.0, 2.0, 4.0]
    run = shared_pipeline(plan, forward, backward, 0.1, [[0]] * 4, cores=2, idle_share=0.2)
    assert run.placements == 1
    # ranks 0 and 2 on one core, 1 and 3 on the other (hyparflow.launch.affinity)
    sim = simulate_shared(plan, forward, backward, 0.1, [{0: 1}, {1: 1}, {0: 1}, {1: 1}],
                          cores=1, idle_share=0.2)  # fmt: skip
    ends = [max(e for (st, _), (_, e) in sim.times.items() if st == s) for s in range(4)]
    assert run.finish == pytest.approx(ends)
    unpinned = shared_pipeline(plan, forward, backward, 0.1, [[0]] * 4, cores=2,
                               idle_share=0.2, pinned=False)  # fmt: skip
    assert run.finish != pytest.approx(unpinned.finish)
    # 2 stages x 2 replicas: each core holds one replica's stage 0 and the other's stage 1
    hybrid = shared_pipeline(one_f_one_b(2, 4), [1.0, 1.0], [2.0, 2.0], 0.0, [[0, 0]] * 2,
                             cores=2)  # fmt: skip
    mixed = simulate_shared(one_f_one_b(2, 4), [1.0, 1.0], [2.0, 2.0], 0.0,
                            [{0: 1, 1: 1}, {0: 1, 1: 1}], cores=1)  # fmt: skip
    assert max(hybrid.finish) == pytest.approx(mixed.makespan)
    # one replica's fill and drain run beside the other's steady state: no bubble is left
    # (2 x 2 x 4 actions of 3 s on 2 cores), where stage-pure cores idle through both
    assert max(hybrid.finish) == pytest.approx(24.0)
    pure = simulate_shared(one_f_one_b(2, 4), [1.0, 1.0], [2.0, 2.0], 0.0, [{0: 2}, {1: 2}],
                           cores=1)  # fmt: skip
    assert pure.makespan == pytest.approx(30.0)
    # predict follows Machine.pinned
    costs, layout = uniform_costs(layers=4), Layout(4, 1, 4)
    network = Network(FAST, oversubscribed_idle_share=0.2)
    skewed = Machine(cores_per_node=2)
    assert predict(costs, network, layout, 64, skewed).step_time != pytest.approx(
        predict(costs, network, layout, 64, Machine(cores_per_node=2, pinned=False)).step_time
    )


def test_unpinned_ranks_short_of_cores_are_averaged_over_their_even_placements():
    from hyparflow.engine.schedule import one_f_one_b
    from hyparflow.simulate.sharing import shared_pipeline, simulate_shared

    plan, forward, backward = one_f_one_b(4, 4), [1.0, 2.0, 1.5, 1.0], [2.0, 3.0, 2.0, 4.0]
    run = shared_pipeline(plan, forward, backward, 0.1, [[0]] * 4, cores=2, idle_share=0.2,
                          pinned=False)  # fmt: skip
    assert run.placements == 3  # {01|23}, {02|13}, {03|12}
    expected = [0.0] * 4
    for pairs in ([0, 0, 1, 1], [0, 1, 0, 1], [0, 1, 1, 0]):
        sim = simulate_shared(plan, forward, backward, 0.1, [{c: 1} for c in pairs], cores=1,
                              idle_share=0.2)  # fmt: skip
        ends = [max(e for (st, _), (_, e) in sim.times.items() if st == s) for s in range(4)]
        expected = [x + e / 3 for x, e in zip(expected, ends)]
    assert run.finish == pytest.approx(expected)
    # three ranks on two cores: one core holds two of them, in three ways
    three = shared_pipeline(one_f_one_b(3, 4), [1.0] * 3, [1.0] * 3, 0.0, [[0]] * 3, cores=2,
                            pinned=False)  # fmt: skip
    assert three.placements == 3
    # too many placements to enumerate: a fixed random sample, so the same answer each time
    wide = [[0, 0, 0, 0]] * 4  # 16 ranks (4 stages x 4 replicas) on a 4-core node
    first = shared_pipeline(plan, forward, backward, 0.0, wide, cores=4, limit=16, pinned=False)
    assert first.placements == 16
    assert first == shared_pipeline(plan, forward, backward, 0.0, wide, cores=4, limit=16,
                                    pinned=False)  # fmt: skip
    roomy = shared_pipeline(plan, forward, backward, 0.0, wide, cores=16)
    spinning = shared_pipeline(plan, forward, backward, 0.0, wide, cores=4, idle_share=1.0)
    assert max(roomy.finish) < max(first.finish) < max(spinning.finish)
    assert max(spinning.finish) == pytest.approx(4 * max(roomy.finish))


def test_a_pipeline_on_too_few_cores_runs_faster_when_waiting_ranks_yield():
    costs = uniform_costs(layers=4)
    layout = Layout(4, 1, 4)
    roomy = predict(costs, Network(FAST), layout, 64, Machine(cores_per_node=4))
    spinning = predict(costs, Network(FAST, oversubscribed_idle_share=1.0), layout, 64,
                       Machine(cores_per_node=2))  # fmt: skip
    yielding = predict(costs, Network(FAST, oversubscribed_idle_share=0.0), layout, 64,
                       Machine(cores_per_node=2))  # fmt: skip
    assert spinning.step_time == pytest.approx(2 * roomy.step_time)
    # the bubble leaves cores to the ranks that compute: faster, never faster than roomy
    assert roomy.step_time < yielding.step_time < spinning.step_time
    assert sum(yielding.stage_compute) > sum(roomy.stage_compute)  # computing, stretched


def test_scheduling_waits_only_where_ranks_outnumber_cores():
    costs = uniform_costs(layers=4)
    waits = Network(FAST, oversubscribed_latency=1.0, oversubscribed_collective_latency=1.0,
                    oversubscribed_wakeup=1.0)  # fmt: skip
    neighbours = Machine(cores_per_node=2, corun=1.2)  # slower cores, but enough of them
    for layout in (Layout(2, 1, 4), Layout(1, 2)):
        calm = predict(costs, Network(FAST), layout, 64, neighbours)
        assert predict(costs, waits, layout, 64, neighbours).step_time == calm.step_time
    for layout in (Layout(4, 1, 4), Layout(1, 4)):
        calm = predict(costs, Network(FAST), layout, 64, neighbours)
        assert predict(costs, waits, layout, 64, neighbours).step_time > calm.step_time + 0.9


def test_a_reduction_waits_for_core_mates_still_computing_on_a_crowded_node():
    from hyparflow.simulate.predict import _reduction_wakeups
    from hyparflow.simulate.sharing import wake_wait

    # 8 bytes between 2 replicas: recursive doubling, one message step
    net = Network(Link(1e-6, 1e9), oversubscribed_wakeup=1.0)
    finish, ends, parts = [10.0, 9.0], [None, None], [None, None]
    # stage 1 gets there first; stage 0 computes 1 s more on the cores they share
    first = _reduction_wakeups(1, 8, 2, finish, ends, parts, net.intra, net, mates=[0])
    assert first == pytest.approx(wake_wait(1.0, 1.0)) and first == pytest.approx(0.75)
    # stage 0 reduces while stage 1 runs its 2 s update (from 9.76 to 11.76)
    ends[1], parts[1] = 9.0 + first + 0.01 + 2.0, (9.0, first + 0.01, 2.0)
    assert _reduction_wakeups(0, 8, 2, finish, ends, parts, net.intra, net, [1]) == pytest.approx(
        wake_wait(1.76, 1.0)
    )
    # nobody computes any more: no wait
    ends[1] = 9.5
    assert _reduction_wakeups(0, 8, 2, finish, ends, parts, net.intra, net, [1]) == 0.0
    # a stage on other nodes is no core-mate
    ends[1] = 11.76
    assert _reduction_wakeups(0, 8, 2, finish, ends, parts, net.intra, net, []) == 0.0
    # in a whole prediction: only the hybrid on too few cores pays it
    costs = uniform_costs(layers=4)
    woken = Network(FAST, oversubscribed_wakeup=1e-3)
    for cores, grows in ((2, True), (4, False)):
        machine = Machine(cores_per_node=cores)
        calm = predict(costs, Network(FAST), Layout(2, 2, 4), 64, machine)
        late = predict(costs, woken, Layout(2, 2, 4), 64, machine)
        assert (late.step_time > calm.step_time) == grows


def test_replicas_on_one_core_wait_for_the_first_out_of_their_reduction():
    from hyparflow.simulate.sharing import replicas_share_a_core

    # data parallel, 4 ranks on 2 cores: each core holds two replicas; the one out of the
    # allreduce first computes on, and its core-mate's last message waits for its tick
    costs = uniform_costs(layers=4, forward=1e-2)  # it computes far longer than 2 W
    woken = Network(FAST, oversubscribed_wakeup=1e-3)
    for pinned in (True, False):
        machine = Machine(cores_per_node=2, pinned=pinned)
        calm = predict(costs, Network(FAST), Layout(1, 4), 256, machine)
        late = predict(costs, woken, Layout(1, 4), 256, machine)
        assert late.pipeline_time == pytest.approx(calm.pipeline_time)
        assert late.allreduce_time == pytest.approx(calm.allreduce_time + 1e-3)
    # a wait far longer than the rank's update and first action: they end it (E[min(held, U)])
    machine = Machine(cores_per_node=2)
    extra = (
        predict(costs, Network(FAST, oversubscribed_wakeup=10.0), Layout(1, 4), 256,
                machine).allreduce_time
        - predict(costs, Network(FAST), Layout(1, 4), 256, machine).allreduce_time
    )  # fmt: skip
    assert 0 < extra < 10.0
    # a core for each replica: no such wait
    for layout, cores in ((Layout(1, 4), 4), (Layout(1, 2), 2)):
        machine = Machine(cores_per_node=cores)
        calm = predict(costs, Network(FAST), layout, 256, machine)
        assert predict(costs, woken, layout, 256, machine).step_time == calm.step_time
    # 2 x 2 on 2 cores: each core holds one replica of each stage (stages mixed)
    assert replicas_share_a_core([[0, 0], [0, 0]], cores=2) == [False, False]
    assert replicas_share_a_core([[0, 0, 0]], cores=2, pinned=False) == [True]


def test_jitter_makes_replicas_wait_for_the_slowest():
    from hyparflow.simulate.predict import expected_maximum

    assert expected_maximum(1) == 0.0
    assert expected_maximum(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    assert expected_maximum(4) == pytest.approx(1.0294, abs=1e-4)
    costs, net = uniform_costs(layers=4), Network(FAST)
    for replicas in (1, 2, 64):
        steady = predict(costs, net, Layout(1, replicas), 64 * replicas)
        noisy = predict(costs, net, Layout(1, replicas), 64 * replicas, Machine(jitter=0.05))
        lag = 0.05 * expected_maximum(replicas)
        assert noisy.step_time == pytest.approx(steady.step_time * (1 + lag))
    assert expected_maximum(512) > expected_maximum(64) > expected_maximum(8)


def test_one_rank_is_plain_fit_when_measured():
    costs = uniform_costs(layers=2)
    costs.single_process = Affine(0.002, 1e-4)
    p = predict(costs, Network(FAST), Layout(), 100)
    assert p.single_process and p.step_time == pytest.approx(0.012)


def test_unsplittable_batches_and_too_many_stages_are_refused():
    costs = uniform_costs(layers=4)
    with pytest.raises(ValueError, match="multiple of 12"):
        predict(costs, Network(FAST), Layout(2, 3, 4), 100)
    with pytest.raises(ValueError, match="fewer partitions"):
        predict(costs, Network(FAST), Layout(8, 1, 1), 8)


def test_time_balanced_split_and_stage_names():
    costs = uniform_costs(layers=6)
    slow = LayerCost("slow", Affine(0, 5e-4), Affine(0, 1e-3), 0, 0)
    costs.layers[0] = slow
    p = predict(costs, Network(FAST), Layout(2, 1, 2), 16)
    assert p.stage_starts == [0, 1] and p.stage_names == ["l1"]


# --- costs --------------------------------------------------------------------------------


def test_affine_through_two_points_stays_non_negative():
    assert Affine.through(32, 0.004, 128, 0.013) == Affine(0.001, 9.375e-05)
    assert Affine.through(32, 0.001, 128, 0.009).fixed == 0.0  # line would cross below zero
    assert Affine.through(32, 0.005, 128, 0.004).per_sample == 0.0  # noise: slope < 0
    assert Affine(0.001, 1e-4).at(10) == pytest.approx(0.002)


def test_costs_file_round_trip(tmp_path):
    costs = uniform_costs(layers=3)
    costs.engine = EngineCosts(forward_call=1e-4, loss=Affine(1e-5, 1e-7), optimizer_fixed=2e-4)
    costs.single_process = Affine(0.003, 2e-5)
    costs.fused = Affine(0.001, 1e-5)
    costs.measured = {"cores": 2}
    path = tmp_path / "costs.json"
    costs.save(path)
    again = ModelCosts.load(path)
    assert again.to_dict() == costs.to_dict()
    assert again.engine == costs.engine and again.layers == costs.layers
    with pytest.raises(ValueError, match="hyparflow costs"):
        ModelCosts.from_dict({"layers": []})
    with pytest.raises(ValueError, match="cut_bytes"):
        ModelCosts("bad", costs.layers, [0.0])


# --- the command line ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    import keras
    from keras import layers

    x = keras.Input((16,))
    h = layers.Dense(32, activation="relu", name="first")(x)
    h = layers.Dense(32, activation="relu", name="second")(h)
    h = layers.Dense(32, activation="relu", name="third")(h)
    model = keras.Model(x, layers.Dense(4, activation="softmax", name="head")(h))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    path = tmp_path_factory.mktemp("simulate") / "tiny.keras"
    model.save(path)
    return path


def test_simulate_command_measures_a_saved_model_and_prints_the_table(saved_model, tmp_path):
    costs_file = tmp_path / "costs.json"
    command = [
        sys.executable, "-m", "hyparflow.cli", "simulate", str(saved_model),
        "--batch-size", "16", "--partitions", "1,2", "--replicas", "1,2", "--microbatches", "2",
        "--latency", "2e-6", "--bandwidth", "12e9", "--profile-batch-sizes", "4,8",
        "--save-costs", str(costs_file),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["P", "R", "M"])
    rows = [line.split() for line in lines[header + 1 : header + 5]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("1", "1", "1"), ("1", "2", "1"), ("2", "1", "2"), ("2", "2", "2"),
    ]  # fmt: skip
    assert rows[0][7] == "1.00" and rows[0][8] == "100.0%"  # the baseline is one rank
    assert all(float(r[5]) > 0 for r in rows)
    saved = ModelCosts.load(costs_file)
    assert [lc.name for lc in saved.layers] == ["first", "second", "third", "head"]
    assert saved.single_process is not None and saved.single_process.at(16) > 0
    assert saved.layers[0].param_bytes == (16 * 32 + 32) * 4 and saved.layers[0].variables == 2


def test_simulate_command_reads_costs_and_prints_json(tmp_path, capsys):
    from hyparflow.cli import main

    path = tmp_path / "costs.json"
    uniform_costs(layers=8).save(path)
    argv = ["simulate", str(path), "--batch-size", "64", "-p", "1,4", "-r", "1,2", "-m", "4",
            "--latency", "2e-6", "--bandwidth", "12e9", "--ranks-per-node", "4",
            "--json"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["partitions"], r["replicas"], r["nodes"]) for r in rows] == [
        (1, 1, 1), (1, 2, 1), (4, 1, 1), (4, 2, 2),
    ]  # fmt: skip
    assert rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] > 1.0 and rows[3]["efficiency"] < 1.0
    assert math.isclose(rows[3]["throughput"], 64 / rows[3]["step_time"])
    assert all(r["between_steps_time"] == 0.0 for r in rows)
    assert main([*argv, "--batch-logs"]) == 0  # the loop shares the logs after every step
    logged = json.loads(capsys.readouterr().out)
    assert all(r["between_steps_time"] > 0.0 for r in logged if r["partitions"] * r["replicas"] > 1)
    assert logged[3]["step_time"] > rows[3]["step_time"]


def test_simulate_command_needs_a_network(tmp_path, capsys):
    from hyparflow.cli import main

    path = tmp_path / "costs.json"
    uniform_costs(layers=2).save(path)
    assert main(["simulate", str(path), "--batch-size", "8"]) == 1
    assert "--latency" in capsys.readouterr().err
