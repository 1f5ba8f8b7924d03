"""The scaling model: network costs, placement, pipeline step, costs files and the CLI."""

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyparflow.auto.search import OUTRUN
from hyparflow.callbacks.aggregate import formula_bubble
from hyparflow.cli import main
from hyparflow.schedule import theoretical_bubble, zero_bubble_bubble
from hyparflow.simulate import (
    Affine,
    EngineCosts,
    LayerCost,
    Layout,
    Link,
    Machine,
    ModelCosts,
    Network,
    predict,
)
from hyparflow.simulate.costs import TensorShare
from hyparflow.simulate.netbench import fit_network, launch
from hyparflow.simulate.network import allreduce, allreduce_times, bucketed_allreduce
from tests.support.cases import LAYOUT_FIELDS
from tests.support.doc_commands import commands

FAST = Link(0.0, 1e30)  # a network that costs nothing
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_NETWORK = "--latency 2e-6 --bandwidth 12e9"  # the command line's link: 2 us, 12 GB/s
PROFILED = "--profile-batch-sizes 4,8"  # a saved model timed at two batch sizes


def _argv(command: str, path, flags: str) -> list:
    """The arguments of `hyparflow <command> <path> <flags>`, the flags as typed in a shell."""
    return [*command.split(), str(path), *flags.split()]


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


# --- network ------------------------------------------------------------------------------


def test_point_to_point_is_latency_plus_bytes_over_bandwidth():
    assert Link(2e-6, 10e9).time(0) == 2e-6
    assert Link(2e-6, 10e9).time(10e9) == pytest.approx(1.0 + 2e-6)
    net = Network(intra=Link(1e-6, 20e9), inter=Link(5e-6, 10e9))
    assert net.link(crosses_nodes=False).time(1e6) == pytest.approx(1e-6 + 1e6 / 20e9)
    assert net.link(crosses_nodes=True).time(1e6) == pytest.approx(5e-6 + 1e6 / 10e9)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link(1e-6, 0.0)


def test_allreduce_algorithms_on_known_cases():
    link = Link(1e-6, 1e9)
    # p = 4, 8 MB: ring 2(p-1) alpha + 2 (p-1)/p n / beta, plus (p-1)/p n / rate
    times = allreduce_times(8e6, 4, link)
    assert times["ring"] == pytest.approx(6e-6 + 0.012)
    assert allreduce_times(8e6, 4, link, 6e9)["ring"] == pytest.approx(6e-6 + 0.012 + 0.001)
    assert times["rabenseifner"] == pytest.approx(4e-6 + 0.012)
    assert times["recursive doubling"] == pytest.approx(2 * (1e-6 + 0.008))
    # non-power-of-two rounds up the log
    assert allreduce_times(8, 5, link)["recursive doubling"] == pytest.approx(3 * (1e-6 + 8e-9))
    assert set(allreduce_times(1e9, 1, link).values()) == {0.0}
    assert allreduce(1e9, 1, link) == (0.0, "none")
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
    net = Network(Link(1e-6, 9e9), Link(2e-6, 12e9), reduce_rate=5e9)
    assert Network.from_dict(json.loads(json.dumps(net.to_dict()))) == net
    alone = Network(Link(1e-6, 9e9))
    assert Network.from_dict(json.loads(json.dumps(alone.to_dict()))) == alone
    # files written before the model's last terms were dropped still load
    older = {**alone.to_dict(), "overhead": 4e-5, "oversubscribed_wakeup": 2e-3}
    assert Network.from_dict(older) == alone
    with pytest.raises(ValueError, match="inter-node"):
        alone.link(crosses_nodes=True)


def test_network_fit_recovers_a_synthetic_machine():
    alpha, beta, rate = 1e-6, 8e9, 4e9
    pingpong = {n: alpha + n / beta for n in (8, 1024, 1 << 20, 4 << 20, 16 << 20)}
    allreduces = {n: 2 * alpha + n / beta + n / 2 / rate for n in (1 << 20, 4 << 20, 16 << 20)}
    fitted = fit_network(pingpong, allreduces, 2)
    assert fitted["intra"]["latency"] == pytest.approx(alpha, rel=0.01)
    assert fitted["intra"]["bandwidth"] == pytest.approx(beta, rel=1e-6)
    assert fitted["reduce_rate"] == pytest.approx(rate, rel=1e-3)
    assert Network.from_dict(fitted).reduce_rate == pytest.approx(rate, rel=1e-3)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_network_is_measured_on_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", REPO)
    measured = Network.from_dict(launch(str(tmp_path / "network.json"), timeout=120))
    # a measurement, so a loose bound: microseconds alone, 2-4 ms seen while other jobs ran; it
    # catches a unit or fitting error, not a slow machine
    assert 0 < measured.intra.latency < 0.05 and measured.intra.bandwidth > 1e8
    assert measured.source["measured"] == "hyparflow.simulate.netbench"
    assert measured.source["cores_got"] > 0


# --- placement ----------------------------------------------------------------------------


def test_placement_follows_the_engine_grid():
    where = Layout(partitions=2, replicas=3, ranks_per_node=2)  # one pipeline per node
    assert where.nodes == 3 and where.per_node == 2
    assert not where.pipeline_link_crosses_nodes(0)
    assert where.stage_nodes(0) == where.stage_nodes(1) == 3
    assert where.offnode_reductions_per_node() == 2
    spread = Layout(partitions=4, replicas=1, ranks_per_node=2)
    assert [spread.pipeline_link_crosses_nodes(s) for s in range(3)] == [False, True, False]
    assert spread.stage_nodes(0) == 1 and spread.offnode_reductions_per_node() == 0
    assert Layout(3, 1).nodes == 1 and Layout(3, 1).per_node == 3
    with pytest.raises(ValueError, match="ranks_per_node"):
        Layout(2, 1, ranks_per_node=0)


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
    costs.engine = EngineCosts(step_fixed=0.25)  # a read-out longer than any step
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


@pytest.mark.parametrize("partitions,microbatches", [(2, 2), (2, 8), (4, 4), (4, 16)])
def test_zero_bubble_splits_the_weight_half_of_each_backward_into_the_bubble(
    partitions, microbatches
):
    costs = uniform_costs(layers=8, forward=1e-4, backward=2e-4)  # every layer has weights
    batch, net = 8 * microbatches, Network(FAST)
    zb = predict(costs, net, Layout(partitions, 1, microbatches, "zero_bubble"), batch)
    one_f_one_b = predict(costs, net, Layout(partitions, 1, microbatches, "1f1b"), batch)
    per_pass = (8 // partitions) * 8 * 1e-4  # F, B and W each: a layer's backward halved
    assert zb.bubble == pytest.approx(
        zero_bubble_bubble(partitions, microbatches, per_pass, per_pass, per_pass)
    )
    assert zb.bubble < one_f_one_b.bubble and zb.step_time < one_f_one_b.step_time
    # with engine costs per call, each W pays one more backward call than 1F1B's passes
    costs.engine = EngineCosts(backward_call=1e-3)
    slower = predict(costs, net, Layout(partitions, 1, microbatches, "zero_bubble"), batch)
    assert slower.stage_compute[0] == pytest.approx(zb.stage_compute[0] + 2e-3 * microbatches)


@pytest.mark.parametrize(
    "partitions,microbatches,virtual", [(2, 2, 2), (2, 4, 2), (4, 8, 2), (2, 4, 4)]
)
def test_interleaved_chunks_divide_the_bubble_and_each_pays_its_engine_calls(
    partitions, microbatches, virtual
):
    costs = uniform_costs(layers=16, forward=1e-4, backward=2e-4)
    batch, net = 8 * microbatches, Network(FAST)
    layout = Layout(partitions, 1, microbatches, "interleaved", virtual_stages=virtual)
    interleaved = predict(costs, net, layout, batch)
    one_f_one_b = predict(costs, net, Layout(partitions, 1, microbatches, "1f1b"), batch)
    assert len(interleaved.stage_starts) == partitions * virtual  # one start per model chunk
    assert interleaved.bubble == pytest.approx(
        formula_bubble(partitions, microbatches, "interleaved", virtual_stages=virtual)
    )
    assert interleaved.step_time < one_f_one_b.step_time
    # each chunk's forward and backward are engine calls of their own: v times 1F1B's
    costs.engine = EngineCosts(forward_call=1e-3, backward_call=1e-3)
    calls = predict(costs, net, layout, batch).stage_compute[0] - interleaved.stage_compute[0]
    assert calls == pytest.approx(2e-3 * microbatches * virtual)
    # the stage's reduction and update cover all its chunks' parameters
    assert interleaved.stage_compute == pytest.approx(one_f_one_b.stage_compute)
    with pytest.raises(ValueError, match="model chunks"):
        predict(uniform_costs(layers=3), net, layout, batch)


def test_data_parallel_step_is_compute_plus_allreduce_plus_optimizer():
    costs = uniform_costs(layers=4)
    costs.engine = EngineCosts(optimizer_fixed=1e-3, optimizer_per_byte=1e-9)
    net = Network(intra=Link(1e-5, 1e9), reduce_rate=2e9)
    p = predict(costs, net, Layout(1, 4), 256, batch_logs=True)
    compute = 4 * 64 * 3e-4
    reduce = allreduce(costs.param_bytes, 4, net.intra, 2e9)[0]
    assert p.allreduce_time == pytest.approx(reduce)
    logs = net.logs_sync(4, 4, crosses_nodes=False)  # metric sums, logs broadcast, stop vote
    assert p.between_steps_time == pytest.approx(logs)
    assert p.step_time == pytest.approx(compute + reduce + 1e-3 + 1e-9 * costs.param_bytes + logs)
    row = p.to_dict()
    assert (row["partitions"], row["replicas"], row["nodes"]) == (1, 4, 1)
    assert row["ranks_per_node"] == 4 and row["throughput"] == pytest.approx(p.throughput)


def test_unpartitioned_model_runs_the_measured_fused_step():
    costs = uniform_costs(layers=4)
    costs.fused = Affine(1e-3, 1e-5)
    costs.engine = EngineCosts(forward_call=5e-3, backward_call=5e-3)  # not paid when fused
    net = Network(intra=Link(1e-5, 1e9), reduce_rate=2e9)
    p = predict(costs, net, Layout(1, 4), 256)
    assert p.pipeline_time == pytest.approx(1e-3 + 1e-5 * 64)  # one call on 64 samples
    assert p.allreduce_time == pytest.approx(allreduce(costs.param_bytes, 4, net.intra, 2e9)[0])
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
    costs.engine = EngineCosts(loss=Affine(1e-3, 0.0))  # the last stage's, per micro-batch
    lossy = predict(costs, Network(FAST), Layout(2, 1, 4), 32)
    assert lossy.stage_compute[1] - lossy.stage_compute[0] == pytest.approx(4 * 1e-3)
    costs.engine = EngineCosts(optimizer_fixed=1e-3, optimizer_per_variable=1e-4)
    updating = predict(costs, Network(FAST), Layout(2, 1, 4), 32)
    assert updating.optimizer_time == pytest.approx(1e-3 + 2 * 1e-4)  # a stage's 2 variables


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
        net = Network(intra=Link(1e-6, beta), inter=Link(3e-6, beta / 2))
        return predict(costs, net, layout, batch).step_time

    assert step(bandwidth * factor) <= step(bandwidth) * (1 + 1e-9)


def test_nodes_with_fewer_cores_than_ranks_are_refused():
    costs, net = uniform_costs(layers=4), Network(FAST)
    for layout in (Layout(1, 4), Layout(4, 1, 4), Layout(2, 2, 2)):
        with pytest.raises(ValueError, match="core per rank"):
            predict(costs, net, layout, 64, Machine(cores_per_node=2))
        assert predict(costs, net, layout, 64, Machine(cores_per_node=4)).step_time > 0
    spread = Layout(1, 4, ranks_per_node=2)  # two nodes of two cores
    two_nodes = Network(FAST, inter=FAST)
    assert predict(costs, two_nodes, spread, 64, Machine(cores_per_node=2)).layout.nodes == 2
    costs.single_process = Affine(0.002, 1e-4)
    assert predict(costs, net, Layout(), 64, Machine(cores_per_node=1)).single_process


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
    costs.layers[0] = LayerCost("slow", Affine(0, 5e-4), Affine(0, 1e-3), 0, 0)
    p = predict(costs, Network(FAST), Layout(2, 1, 2), 16)
    assert p.stage_starts == [0, 1] and p.stage_names == ["l1"]
    pinned = predict(costs, Network(FAST), Layout(2, 1, 2), 16, starts=[0, 5])
    assert pinned.stage_names == ["l5"] and pinned.step_time > p.step_time


# --- costs --------------------------------------------------------------------------------


def test_affine_through_two_points_stays_non_negative():
    assert Affine.through(32, 0.004, 128, 0.013) == Affine(0.001, 9.375e-05)
    assert Affine.through(32, 0.001, 128, 0.009).fixed == 0.0  # line would cross below zero
    assert Affine.through(32, 0.005, 128, 0.004).per_sample == 0.0  # noise: slope < 0
    assert Affine(0.001, 1e-4).at(10) == pytest.approx(0.002)
    assert Affine.of([1, 2]) == Affine.of({"fixed": 1, "per_sample": 2}) == Affine(1.0, 2.0)


def test_costs_file_round_trip(tmp_path):
    costs = uniform_costs(layers=3)
    costs.layers[1] = replace(costs.layers[1], tensor=TensorShare(4000, 1.0, 512.0, 256.0, 1, 1))
    costs.engine = EngineCosts(
        forward_call=1e-4,
        loss=Affine(1e-5, 1e-7),
        optimizer_fixed=2e-4,
        collective_call=3e-5,
        sharded_update_per_byte=1e-10,
    )
    costs.single_process = Affine(0.003, 2e-5)
    costs.fused = Affine(0.001, 1e-5)
    costs.measured = {"cores": 2}
    path = tmp_path / "costs.json"
    costs.save(path)
    again = ModelCosts.load(path)
    assert again.to_dict() == costs.to_dict()
    assert again.engine == costs.engine and again.layers == costs.layers
    older = {**costs.to_dict(), "engine": {**costs.to_dict()["engine"], "retired": 1.0}}
    assert ModelCosts.from_dict(older).engine == costs.engine  # unknown terms are ignored
    with pytest.raises(ValueError, match="hyparflow costs"):
        ModelCosts.from_dict({"layers": []})
    with pytest.raises(ValueError, match="cut_bytes"):
        ModelCosts("bad", costs.layers, [0.0])


def test_tensor_ranks_split_work_and_weights_and_pay_their_exchanges():
    from hyparflow.auto.tensor_price import tensor_costs

    costs = uniform_costs(layers=2, forward=1e-4, backward=2e-4, param_bytes=4000)
    # layer 0 splits whole: its output summed forward (1 kB per sample), its input's gradient
    # backward (500 B); layer 1 stays whole
    costs.layers[0] = replace(costs.layers[0], tensor=TensorShare(4000, 1.0, 1000.0, 500.0, 1, 1))
    costs.engine = EngineCosts(collective_call=1e-5)
    costs.fused = Affine(1e-3, 6e-4)
    costs.measured = {"tensor_parts": 2, "batch_sizes": [16, 64]}
    network = Network(Link(1e-5, 1e9))
    split = tensor_costs(costs, 2, network)
    first, second = split.layers

    def summed(nbytes):  # one allreduce over 2 ranks plus the host round trip
        return allreduce(nbytes, 2, network.intra)[0] + 1e-5

    assert first.forward.at(64) == pytest.approx(64 * 1e-4 / 2 + summed(64 * 1000))
    assert first.backward.at(64) == pytest.approx(64 * 2e-4 / 2 + summed(64 * 500))
    assert first.param_bytes == 2000 and second == costs.layers[1]
    # the one-call step keeps the share of the per-sample work its layers keep (3/4: half of
    # layer 0's), and pays the same exchanges
    exchanges = summed(64 * 1000) + summed(64 * 500)
    assert split.fused.at(64) == pytest.approx(1e-3 + 0.75 * 6e-4 * 64 + exchanges)
    assert split.single_process is None  # one rank of T runs the engine, not model.fit
    assert tensor_costs(costs, 1, network) is costs
    costs.measured = {}
    with pytest.raises(ValueError, match="no tensor shares"):
        tensor_costs(costs, 2, network)


def test_scaled_costs_stretch_every_time():
    costs = uniform_costs(layers=4)
    costs.engine = EngineCosts(forward_call=1e-3, loss=Affine(1e-4, 1e-6), step_fixed=2e-3)
    costs.single_process, costs.fused = Affine(0.003, 2e-5), Affine(0.001, 1e-5)
    slower = costs.scaled(2.0)
    assert slower.engine.forward_call == 2e-3 and slower.engine.loss == Affine(2e-4, 2e-6)
    assert slower.single_process == Affine(0.006, 4e-5) and slower.fused == Affine(0.002, 2e-5)
    net, layout = Network(FAST), Layout(2, 1, 4)
    assert predict(slower, net, layout, 32).step_time == pytest.approx(
        2 * predict(costs, net, layout, 32).step_time
    )


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
    layouts = f"--batch-size 16 --partitions 1,2 --replicas 1,2 --microbatches 2 {FAST_NETWORK}"
    argv = _argv("simulate", saved_model, f"{layouts} {PROFILED} --cores-per-node 4")
    command = [sys.executable, "-m", "hyparflow.cli", *argv, "--save-costs", str(costs_file)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["P", "R", "M"])
    rows = [line.split() for line in lines[header + 1 : header + 5]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("1", "1", "1"),
        ("1", "2", "1"),
        ("2", "1", "2"),
        ("2", "2", "2"),
    ]
    assert rows[0][7] == "1.00" and rows[0][8] == "100.0%"  # the baseline is one rank
    assert all(float(r[5]) > 0 for r in rows)
    saved = ModelCosts.load(costs_file)
    assert [lc.name for lc in saved.layers] == ["first", "second", "third", "head"]
    assert saved.single_process is not None and saved.single_process.at(16) > 0
    assert saved.fused is not None and saved.fused.at(16) > 0
    assert saved.layers[0].param_bytes == (16 * 32 + 32) * 4 and saved.layers[0].variables == 2
    engine = saved.engine
    assert engine.forward_call + engine.backward_call > 0 and engine.loss.at(16) > 0
    assert engine.optimizer(2, 1000) > 0 and saved.measured["stage_fit"]["forward"][-1] < 1


def test_simulate_command_reads_costs_and_prints_json(tmp_path, capsys):
    path = tmp_path / "costs.json"
    uniform_costs(layers=8).save(path)
    layouts = "--batch-size 64 -p 1,4 -r 1,2 -m 4"
    argv = _argv("simulate", path, f"{layouts} {FAST_NETWORK} --ranks-per-node 4 --json")
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["partitions"], r["replicas"], r["nodes"]) for r in rows] == [
        (1, 1, 1),
        (1, 2, 1),
        (4, 1, 1),
        (4, 2, 2),
    ]
    assert rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] > 1.0 and rows[3]["efficiency"] < 1.0
    assert math.isclose(rows[3]["throughput"], 64 / rows[3]["step_time"])
    assert all(r["between_steps_time"] == 0.0 for r in rows)
    assert main([*argv, "--batch-logs"]) == 0  # the loop shares the logs after every step
    logged = json.loads(capsys.readouterr().out)
    assert all(r["between_steps_time"] > 0.0 for r in logged if r["partitions"] * r["replicas"] > 1)
    assert logged[3]["step_time"] > rows[3]["step_time"]
    # weak scaling: against the same layout on one node, at the same batch per rank
    assert main([*argv, "--baseline", "node"]) == 0
    weak = json.loads(capsys.readouterr().out)
    assert weak[2]["speedup"] == pytest.approx(1.0)  # 4 x 1 fills one node: it is its baseline
    assert weak[3]["efficiency"] == pytest.approx(weak[3]["speedup"] / 2)  # per node, 2 nodes


def test_simulate_command_prices_interleaved_chunks(tmp_path, capsys):
    path = tmp_path / "costs.json"
    uniform_costs(layers=8).save(path)
    argv = _argv("simulate", path, f"--batch-size 64 -p 2 -m 4 {FAST_NETWORK}")
    assert main([*argv, "--schedule", "interleaved", "-v", "2"]) == 0
    assert "interleaved (v=2) schedule" in capsys.readouterr().out
    rows = {}
    for schedule in ("1f1b", "interleaved"):
        assert main([*argv, "--schedule", schedule, "--json"]) == 0
        rows[schedule] = json.loads(capsys.readouterr().out)[-1]
    assert (
        rows["interleaved"]["virtual_stages"] == 2 and len(rows["interleaved"]["stage_starts"]) == 4
    )
    assert rows["interleaved"]["bubble"] < rows["1f1b"]["bubble"]


def test_simulate_command_skips_layouts_short_of_cores(tmp_path, capsys):
    path = tmp_path / "costs.json"
    uniform_costs(layers=4).save(path)
    argv = _argv(
        "simulate", path, f"--batch-size 64 -p 1,2 -r 1,2 -m 2 {FAST_NETWORK} --cores-per-node 2"
    )
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "skipped 2x2" in err and "core per rank" in err
    assert "Cores per node: 2" in out and len(out.splitlines()) == 7  # 3 header + 3 rows + 1
    assert main([*argv, "-p", "4", "-r", "4"]) == 1  # nothing left to print


def test_simulate_command_needs_a_network(tmp_path, capsys):
    path = tmp_path / "costs.json"
    uniform_costs(layers=2).save(path)
    assert main(["simulate", str(path), "--batch-size", "8"]) == 1
    assert "--latency" in capsys.readouterr().err


def test_plan_auto_is_listed_and_names_itself_in_its_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--auto" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--auto", "--help"])
    assert "without these, this machine's is measured" in capsys.readouterr().out  # issue 66
    missing = str(tmp_path / "missing.keras")
    network = ["--latency", "2e-6", "--bandwidth", "12e9"]
    assert main(["plan", "--auto", missing, "--ranks", "2", "--batch", "8", *network]) == 1
    assert capsys.readouterr().err.startswith("hyparflow plan --auto: ")


def test_simulate_auto_picks_a_layout_and_explains_the_others(tmp_path, capsys):
    path = tmp_path / "costs.json"
    uniform_costs(layers=8, param_bytes=4 * 2**20).save(path)  # 32 MiB of gradients
    argv = _argv("simulate", path, "--batch-size 64 --auto 4 --latency 5e-5 --bandwidth 1e8")
    assert main([*argv, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    pick = found["pick"]
    assert pick["partitions"] * pick["replicas"] * pick["tensor"] == 4 and pick["reason"] is None
    assert pick["partitions"] > 1  # at 100 MB/s a 32 MiB allreduce costs more than a bubble
    assert {"schedule", "microbatches", "memory_per_rank_bytes"} <= set(pick)
    steps = [r["step_seconds"] for r in found["ranked"]]
    assert steps == sorted(steps) and found["ranked"][0] == pick
    tensor = [r for r in found["rejected"] if r["tensor"] > 1]  # costs without tensor shares
    assert tensor and all("no tensor shares" in r["reason"] for r in tensor)
    assert all(r["reason"] == OUTRUN for r in found["rejected"] if r["tensor"] == 1)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"auto: {pick['label']} (") and "runner-up" in text
    assert "rejected" in text and "slower" in text
    plain = found["data_parallel"]  # the fastest P1 T1 layout, and how much the pick beats it
    assert plain["label"].startswith("P1 R4 T1") and plain in found["ranked"]
    assert (
        found["speedup_over_data_parallel"]
        == pytest.approx(plain["step_seconds"] / pick["step_seconds"])
        and found["speedup_over_data_parallel"] > 1
    )
    assert f"data parallelism: {plain['label']} at" in text
    assert main([*argv, "--memory", "1GiB"]) == 1  # no model, no memory plan
    assert "--memory needs the model" in capsys.readouterr().err


def test_simulate_auto_keeps_layouts_within_the_memory_budget(saved_model, capsys):
    import keras

    from hyparflow.memory import memory_plan
    from hyparflow.strategy import Strategy

    argv = _argv(
        "plan --auto", saved_model, f"--ranks 2 --batch 16 {FAST_NETWORK} {PROFILED} --json"
    )
    assert main(argv) == 0
    found = json.loads(capsys.readouterr().out)
    every = found["ranked"]
    # a model timed here is timed with its tensor shares: its Dense pairs split, T=2 is priced,
    # ranked or outrun by its compute bound alone (which the measured times decide: under load
    # either happens), never refused as unrunnable
    outrun = [r for r in found["rejected"] if r["reason"].startswith("slower than the pick")]
    assert any(r["tensor"] == 2 for r in every + outrun)
    model = keras.saving.load_model(saved_model)
    for layout in every[:3]:  # the bytes are the memory plan's, of a hf.scope() build: what
        # plan --auto assumes for a saved file, read without its weights (issue 66)
        fields = (*LAYOUT_FIELDS, "shard_gradients", "shard_weights", "virtual_stages")
        options = {k: layout[k] for k in fields}
        plan = memory_plan(model, Strategy(**options), batch_size=16, whole_model=False)
        assert layout["memory_per_rank_bytes"] == plan.largest.total
    sizes = sorted(r["memory_per_rank_bytes"] for r in every)
    budget = (sizes[0] + sizes[-1]) // 2
    assert main([*argv, "--memory", str(budget)]) == 0
    fitting = json.loads(capsys.readouterr().out)
    assert all(r["memory_per_rank_bytes"] <= budget for r in fitting["ranked"])
    over = [r for r in fitting["rejected"] if "per rank, over" in r["reason"]]
    assert over and all(r["memory_per_rank_bytes"] > budget for r in over)
    assert main([*argv, "--memory", str(sizes[0] - 1)]) == 1
    assert "no layout fits" in capsys.readouterr().err


def test_the_planner_times_tensor_shares_and_the_hosts_extra_work(saved_model):
    import keras

    from hyparflow.auto.planner_costs import with_planner_costs
    from hyparflow.simulate.measure import measure_model

    model = keras.saving.load_model(saved_model)  # Dense(32) x 3, then the head
    costs = with_planner_costs(measure_model(model, (4, 8), fit_batch_sizes=()), model, 4)
    assert costs.measured["tensor_parts"] == 2
    shares = {layer.name: layer.tensor for layer in costs.layers}
    # first -> second is a column/row pair: the row's output (32 floats) is summed forward;
    # the column's input is the model's own, which takes no gradient: nothing backward
    assert shares["first"].split_fraction == 1.0 and shares["first"].backward_calls == 0
    assert (shares["second"].forward_bytes, shares["second"].forward_calls) == (128.0, 1)
    assert shares["second"].split_bytes > 0
    # third -> head is the second pair: third's input (32 floats) takes a gradient backward,
    # head's 4 outputs are summed forward
    assert (shares["third"].backward_bytes, shares["head"].forward_bytes) == (128.0, 16.0)
    # ZeRO-1's engine parts, run on one replica, move bytes the plain update does not; a host
    # function's round trip in a compiled call is a few microseconds, at most
    assert costs.engine.sharded_update_per_byte > 0 and 0 <= costs.engine.collective_call < 1e-3


def test_plan_auto_on_the_papers_resnet_1001_setting(tmp_path, capsys):
    """`hyparflow plan --auto` on HyPar-Flow's ResNet-1001 run (128 Stampede2-like nodes of 48
    cores, a rank per core, 8 samples per rank): the inputs benchmarks/paper_projection.py
    writes with --save-inputs, searched over 6,144 ranks."""
    sys.path.insert(0, REPO)
    from benchmarks import paper_projection as paper

    network = Network(intra=Link(0.5e-6, 10e9), inter=Link(1.5e-6, 12e9), reduce_rate=4e9)
    costs = paper.expand_to_resnet1001(paper.load_cell(remeasure=False)).scaled(1.5)
    paper.save_inputs(str(tmp_path), "stampede2", costs, network)
    # the command docs/auto.md shows, as written, in the folder the inputs went to
    (shown,) = [c for c in commands("auto.md", "hyparflow plan --auto") if "DIR/" in c[3]]
    argv = [word.replace("DIR/", f"{tmp_path}/") for word in shown[1:]]
    assert main([*argv, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    pick = found["pick"]
    assert pick["partitions"] * pick["replicas"] * pick["tensor"] == 6144
    assert {"microbatches", "schedule", "memory_per_rank_bytes"} <= set(pick)
    assert found["data_parallel"]["label"] == "P1 R6144 T1 M1"
    assert found["speedup_over_data_parallel"] >= 1
    assert any(r["partitions"] > 1 for r in found["ranked"])  # pipelines were simulated
    assert any(r["reason"] == OUTRUN for r in found["rejected"])  # and the hopeless bounded
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "data parallelism: P1 R6144 T1 M1 at" in text and text.startswith("auto: ")
