"""auto/search.py, auto/estimate.py: layouts of a world size, priced; the fastest that fits."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyparflow.auto.estimate import Estimator
from hyparflow.auto.search import (
    OUTRUN,
    PRICED_SCHEDULES,
    Candidate,
    Estimate,
    candidates,
    search,
)
from hyparflow.simulate.costs import Affine, EngineCosts, LayerCost, ModelCosts, TensorShare
from hyparflow.simulate.network import Link, Network


def _estimate(candidate: Candidate) -> Estimate:
    """A made-up model: pipelines pay a bubble, replicas an allreduce, recompute a forward;
    bytes fall with partitions, micro-batches, recompute and ZeRO."""
    p, r, m = candidate.partitions, candidate.replicas, candidate.microbatches
    bubble = (p - 1) / (m + p - 1)
    compute = 1.0 / candidate.world * (1.3 if candidate.recompute else 1.0)
    step = compute / (1 - bubble) + 0.05 * (r > 1) + 0.02 * candidate.tensor
    activations = 8 / (p * m) * (0.3 if candidate.recompute else 1.0)
    optimizer = 2 / (p * candidate.tensor) / (r if candidate.shard_optimizer else 1)
    return Estimate(step, int((activations + optimizer + 1 / p) * 2**30))


def test_every_layout_multiplies_to_the_world_and_splits_the_batch():
    layouts = candidates(4, 64, layers=3)
    assert len(set(layouts)) == len(layouts)
    assert all(c.world == 4 for c in layouts)
    assert all(64 % (c.replicas * c.microbatches) == 0 for c in layouts)
    assert all(c.partitions <= 3 for c in layouts)  # never more stages than layers
    labels = {c.label() for c in layouts}
    assert {"P1 R4 T1 M1", "P2 R2 T1 M4 1f1b recompute zero", "P1 R1 T4 M1"} <= labels
    assert not any(c.partitions == 1 and c.schedule != "gpipe" for c in layouts)
    assert not any(c.replicas == 1 and c.shard_optimizer for c in layouts)
    assert "P1 R4 T1 M2 zero2" in labels  # ZeRO-2 implies ZeRO-1, never alone
    assert all(c.shard_optimizer for c in layouts if c.shard_gradients)
    assert "P1 R4 T1 M2 zero3" in labels  # ZeRO-3 implies both
    assert all(c.shard_gradients for c in layouts if c.shard_weights)
    # its stages gather for each call: none under a split backward or chunks
    split = ("zero_bubble", "interleaved")
    assert not any(c.shard_weights and c.partitions > 1 and c.schedule in split for c in layouts)


def test_microbatches_are_powers_of_two_or_multiples_of_the_stages():
    counts = {c.microbatches for c in candidates(3, 96, layers=8) if c.partitions == 3}
    assert counts == {1, 2, 4, 8, 16, 3, 6, 12, 24}  # not 48 = 16P: it ends at 8P


def test_the_pick_is_the_fastest_and_the_others_say_how_much_slower():
    result = search(candidates(4, 64, layers=8), _estimate, 64)
    times = [v.estimate.step_seconds for v in result.ranked]
    assert times == sorted(times) and result.pick.reason is None
    assert result.runner_up.reason.endswith("% slower")
    # P4 with 32 micro-batches (8P): 0.25 s / (32/35) = 0.273 s, against 0.306 s for P2 x T2
    # with 16, 0.32 s for R=4 (allreduce) and 0.33 s for T=4
    assert result.pick.candidate.label() == "P4 R1 T1 M32 1f1b"  # 1f1b before gpipe on a tie
    assert result.line().startswith("auto: P4 R1 T1 M32 1f1b (") and "runner-up" in result.line()


def _compute_alone(candidate: Candidate) -> float:
    """A bound of `_estimate`: its compute without the bubble, allreduce or tensor exchanges."""
    return 1.0 / candidate.world * (1.3 if candidate.recompute else 1.0)


def test_a_bound_skips_only_layouts_that_cannot_win():
    layouts = candidates(8, 64, layers=8)
    full = search(layouts, _estimate, 64)
    pruned = search(layouts, _estimate, 64, bound=_compute_alone)
    assert pruned.pick == full.pick and len(pruned.ranked) + len(pruned.rejected) == len(layouts)
    skipped = [v for v in pruned.rejected if v.reason == OUTRUN]
    assert skipped and all(v.estimate is None for v in skipped)
    fastest = full.pick.estimate.step_seconds
    assert all(_estimate(v.candidate).step_seconds > fastest for v in skipped)


def test_a_budget_rules_out_layouts_and_says_why():
    budget = int(1.5 * 2**30)
    result = search(candidates(4, 64, layers=8), _estimate, 64, budget_bytes=budget)
    assert all(v.estimate.bytes_per_rank <= budget for v in result.ranked)
    over = [v for v in result.rejected if "per rank, over 1.50 GiB" in v.reason]
    assert over and all(v.estimate.bytes_per_rank > budget for v in over)
    assert result.pick.candidate.partitions > 1  # data parallelism does not fit


def test_refusals_are_kept_with_their_reason():
    def no_tensor(candidate):
        if candidate.tensor > 1:
            raise ValueError("no layer to split")
        return _estimate(candidate)

    result = search(candidates(2, 16, layers=4), no_tensor, 16)
    refused = [v for v in result.rejected if v.reason == "no layer to split"]
    assert refused and all(v.candidate.tensor == 2 and v.estimate is None for v in refused)
    assert all(v.candidate.tensor == 1 for v in result.ranked)


def test_nothing_fits_names_the_smallest_layout():
    with pytest.raises(ValueError, match=r"no layout fits 1\.0 MiB per rank; the smallest, P2"):
        search(candidates(2, 16, layers=4), _estimate, 16, budget_bytes=2**20)


def test_strategy_options_name_the_kind():
    assert Candidate(replicas=2).strategy_options()["kind"] == "data"
    assert Candidate(partitions=2).strategy_options()["kind"] == "model"
    assert Candidate(partitions=2, replicas=2).strategy_options()["kind"] == "hybrid"


@given(
    world=st.sampled_from([1, 2, 3, 4, 6, 8, 12]),
    batch=st.sampled_from([8, 12, 24, 64]),
    layers=st.integers(1, 10),
    budget=st.one_of(st.none(), st.integers(2**29, 2**33)),
)
def test_every_layout_is_ranked_or_rejected_and_the_pick_is_fastest(world, batch, layers, budget):
    layouts = candidates(world, batch, layers=layers)
    try:
        result = search(layouts, _estimate, batch, budget_bytes=budget)
    except ValueError as error:
        assert "no layout fits" in str(error)
        return
    assert len(result.ranked) + len(result.rejected) == len(layouts)
    fastest = min(v.estimate.step_seconds for v in result.ranked)
    assert result.pick.estimate.step_seconds == fastest
    # the same inputs in another order give the same pick (every rank decides alike)
    again = search(list(reversed(layouts)), _estimate, batch, budget_bytes=budget)
    assert again.pick.candidate == result.pick.candidate


# --- the estimator from the scaling model (auto/estimate.py) --------------------------------


def _costs(param_bytes: int, layers: int = 8) -> ModelCosts:
    """`layers` equal layers: 1e-4 s forward and 2e-4 s backward per sample, `param_bytes`
    each, 1 kB per sample across every cut; an optimizer step of 1 ns per byte."""
    return ModelCosts(
        "uniform",
        [
            LayerCost(f"l{i}", Affine(0, 1e-4), Affine(0, 2e-4), param_bytes, 2)
            for i in range(layers)
        ],
        [0.0] + [1000.0] * (layers - 1) + [0.0],
        engine=EngineCosts(optimizer_per_byte=1e-9),
    )


SLOW = Network(intra=Link(5e-5, 1e8))  # 100 MB/s: gradient allreduces dominate heavy models


def _pick(costs, world, batch, network=SLOW, budget_bytes=None, **options):
    estimate = Estimator(costs, network, batch, **options)
    layouts = candidates(world, batch, layers=len(costs.layers))
    return search(layouts, estimate, batch, budget_bytes=budget_bytes)


def test_weight_heavy_models_pipeline_and_light_ones_replicate():
    heavy = _pick(_costs(param_bytes=16 * 2**20), 2, 64).pick.candidate
    light = _pick(_costs(param_bytes=1000), 2, 64).pick.candidate
    assert heavy.partitions == 2 and heavy.replicas == 1  # 128 MiB allreduced at 100 MB/s
    assert light.partitions == 1 and light.replicas == 2  # no bubble, a tiny allreduce


@settings(deadline=None, max_examples=40)  # each example simulates every layout
@given(
    world=st.sampled_from([2, 4, 6, 8]),
    batch=st.sampled_from([16, 48, 96]),
    forward=st.tuples(st.floats(0, 1e-3), st.floats(0, 1e-4)),
    backward=st.tuples(st.floats(0, 1e-3), st.floats(0, 2e-4)),
    layers=st.integers(2, 12),
    fused=st.booleans(),
)
def test_no_prediction_goes_below_the_estimators_bound(
    world, batch, forward, backward, layers, fused
):
    share = TensorShare(4096, 0.5, 300.0, 200.0, 1, 1)  # half of each layer splits
    costs = ModelCosts(
        "drawn",
        [
            LayerCost(f"l{i}", Affine(*forward), Affine(*backward), 4096 * (i + 1), 2, share)
            for i in range(layers)
        ],
        [0.0] + [500.0] * (layers - 1) + [0.0],
        engine=EngineCosts(forward_call=1e-4, optimizer_per_byte=1e-9, collective_call=1e-5),
        fused=Affine(forward[0] * layers, (forward[1] + backward[1]) * layers) if fused else None,
        measured={"tensor_parts": 2},
    )
    two_nodes = Network(intra=Link(5e-5, 1e8), inter=Link(2e-4, 2e7))
    estimate = Estimator(costs, two_nodes, batch, ranks_per_node=world // 2)
    for candidate in candidates(world, batch, layers=layers, schedules=PRICED_SCHEDULES):
        assert estimate(candidate).step_seconds >= estimate.bound(candidate) * (1 - 1e-9)


def test_interleaved_candidates_hold_two_chunks_a_stage_and_are_priced_as_such():
    layouts = candidates(4, 32, layers=6, schedules=("interleaved",))
    pipelines = [c for c in layouts if c.partitions > 1]
    assert pipelines and all(c.virtual_stages == 2 and c.tensor == 1 for c in pipelines)
    assert {c.partitions for c in pipelines} == {2}  # 4 x 2 chunks exceed 6 layers
    assert "v2" in pipelines[0].label()
    assert pipelines[0].strategy_options()["virtual_stages"] == 2
    estimate = Estimator(_costs(param_bytes=4096, layers=6), SLOW, 32)
    one_f_one_b = replace(pipelines[0], schedule="1f1b", virtual_stages=1)
    assert estimate(pipelines[0]).step_seconds != estimate(one_f_one_b).step_seconds


def test_recompute_costs_a_forward_and_zero_trades_optimizer_time_for_host_copies():
    costs = _costs(param_bytes=2**20)  # 8 layers of 1 MiB and 2 variables each
    estimate = Estimator(costs, SLOW, 64)
    plain = estimate(Candidate(partitions=2, microbatches=4, schedule="1f1b"))
    again = estimate(Candidate(partitions=2, microbatches=4, schedule="1f1b", recompute=True))
    assert again.step_seconds > plain.step_seconds + 4 * 1e-4 * 16  # a stage forward, 4 x 16 rows
    replicated = estimate(Candidate(replicas=2)).step_seconds
    sharded = estimate(Candidate(replicas=2, shard_optimizer=True)).step_seconds
    # each replica updates half of the 8 MiB (4 MiB x 1 ns less) and broadcasts each of the
    # 16 variables' pieces (a latency each)
    assert replicated - sharded == pytest.approx(4 * 2**20 * 1e-9 - 16 * SLOW.intra.latency)
    # copying 8 MiB out and back on the host at 1 ns per byte loses more than that saves
    costs.engine = replace(costs.engine, sharded_update_per_byte=1e-9)
    costly = Estimator(costs, SLOW, 64)(Candidate(replicas=2, shard_optimizer=True))
    assert costly.step_seconds == pytest.approx(sharded + 8 * 2**20 * 1e-9)
    assert costly.step_seconds > replicated


def test_sharded_gradients_cost_a_reduce_scatter_per_micro_batch():
    """ZeRO-2 reduce-scatters every micro-batch's gradients, each half an allreduce's bytes:
    with one micro-batch it costs what ZeRO-1 does, with 4 it adds 3 half allreduces."""
    estimate = Estimator(_costs(param_bytes=2**20), SLOW, 64)
    for m in (1, 4):
        zero = estimate(Candidate(replicas=2, microbatches=m, shard_optimizer=True))
        zero2 = estimate(
            Candidate(replicas=2, microbatches=m, shard_optimizer=True, shard_gradients=True)
        )
        allreduce = SLOW.gradient_allreduce(8 * 2**20, 2, False, 1)
        extra = zero2.step_seconds - zero.step_seconds
        assert extra == pytest.approx((m - 1) / 2 * allreduce, abs=1e-12), m


def test_sharded_weights_cost_two_gathers_per_micro_batch_and_a_recomputed_forward():
    """ZeRO-3 all-gathers the weights for each micro-batch's forward and backward, none after
    the update (ZeRO-2's one): 2M - 1 half allreduces more than ZeRO-2, and its stages
    recompute their forward, as `recompute=True` prices it."""
    estimate = Estimator(_costs(param_bytes=2**20), SLOW, 64)
    allreduce = SLOW.gradient_allreduce(8 * 2**20, 2, False, 1)
    for m in (1, 4):
        zero2 = Candidate(replicas=2, microbatches=m, shard_optimizer=True, shard_gradients=True)
        zero3 = replace(zero2, shard_weights=True)
        extra = estimate(zero3).step_seconds - estimate(zero2).step_seconds
        recomputed = estimate.bound(zero3) - estimate.bound(zero2)
        assert recomputed > 0, m
        assert extra == pytest.approx((2 * m - 1) / 2 * allreduce + recomputed, rel=1e-6), m


def test_tensor_ranks_are_priced_from_measured_shares_or_refused_with_the_reason():
    result = _pick(_costs(param_bytes=1000, layers=1), 2, 64)
    reasons = {v.candidate.label(): v.reason for v in result.rejected}
    assert "no tensor shares" in reasons["P1 R1 T2 M1"]  # costs timed without them
    assert not any(c.partitions == 2 for c in candidates(2, 64, layers=1))  # one layer: no cut
    # weight-heavy layers that split whole, exchanging 1 kB per sample each way: T=2 holds
    # and updates half the weights and reduces none of them, where replicas allreduce 128 MiB
    heavy = _split_costs(_costs(param_bytes=16 * 2**20), forward_bytes=1000.0)
    assert _unpipelined_pick(heavy).tensor == 2
    # light layers whose activations are large: the exchanges cost more than replicas' sums
    light = _split_costs(_costs(param_bytes=1000), forward_bytes=1e6)
    assert _unpipelined_pick(light).tensor == 1


def _unpipelined_pick(costs: ModelCosts) -> Candidate:
    """The pick among 2 ranks' layouts without a pipeline: replicas or tensor ranks."""
    layouts = [c for c in candidates(2, 64, layers=len(costs.layers)) if c.partitions == 1]
    return search(layouts, Estimator(costs, SLOW, 64), 64).pick.candidate


def _split_costs(costs: ModelCosts, forward_bytes: float) -> ModelCosts:
    """`costs` whose every layer splits whole over tensor ranks, summing `forward_bytes` per
    sample forward and backward."""
    share = TensorShare(costs.layers[0].param_bytes, 1.0, forward_bytes, forward_bytes, 1, 1)
    layers = [replace(layer, tensor=share) for layer in costs.layers]
    return replace(costs, layers=layers, measured={"tensor_parts": 2})


def test_a_memory_budget_makes_the_planner_recompute():
    def memory(candidate):  # activations of a micro-batch per stage, cut 4x by recompute
        activations = 2**30 / (candidate.partitions * candidate.microbatches)
        return int(activations / (4 if candidate.recompute else 1))

    costs = _costs(param_bytes=16 * 2**20)
    free = _pick(costs, 2, 64, memory=memory).pick.candidate
    tight = _pick(costs, 2, 64, memory=memory, budget_bytes=2**30 // 64).pick.candidate
    assert not free.recompute
    assert memory(tight) <= 2**30 // 64 and tight.recompute
