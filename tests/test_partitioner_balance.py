"""The exact contiguous split (balance DP) against brute force, and its cost model."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyparflow.partitioner.balance import split_between, split_contiguous, stage_costs


def brute_force_bottleneck(costs, num_parts, cut_costs=None):
    n = len(costs)
    return min(
        max(stage_costs(costs, [0, *cuts], cut_costs))
        for cuts in itertools.combinations(range(1, n), num_parts - 1)
    )


costs_lists = st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=9)


@settings(max_examples=300, deadline=None)
@given(costs=costs_lists, data=st.data())
def test_split_is_optimal_against_brute_force(costs, data):
    num_parts = data.draw(st.integers(1, len(costs)))
    starts = split_contiguous(costs, num_parts)
    assert len(starts) == num_parts and starts[0] == 0 and starts == sorted(set(starts))
    assert max(stage_costs(costs, starts)) == pytest.approx(
        brute_force_bottleneck(costs, num_parts), rel=1e-12, abs=1e-12
    )


@settings(max_examples=300, deadline=None)
@given(costs=costs_lists, data=st.data())
def test_split_with_cut_costs_is_optimal_against_brute_force(costs, data):
    num_parts = data.draw(st.integers(1, len(costs)))
    cuts = data.draw(st.lists(st.floats(0, 100), min_size=len(costs) + 1, max_size=len(costs) + 1))
    starts = split_contiguous(costs, num_parts, cuts)
    assert len(starts) == num_parts and starts == sorted(set(starts))
    assert max(stage_costs(costs, starts, cuts)) == pytest.approx(
        brute_force_bottleneck(costs, num_parts, cuts), rel=1e-12, abs=1e-12
    )


def test_cut_costs_move_the_cut_to_a_cheap_boundary():
    costs = [1, 1, 1, 1]
    assert split_contiguous(costs, 2) == [0, 2]
    expensive_middle = [0, 0, 10, 0, 0]
    assert split_contiguous(costs, 2, expensive_middle) in ([0, 1], [0, 3])


def test_every_stage_is_non_empty_even_with_zero_costs():
    starts = split_contiguous([0, 0, 0, 5, 0], 4)
    assert len(starts) == 4 and len(set(starts)) == 4


def test_stage_costs_sums_compute_and_both_cuts():
    assert stage_costs([1, 2, 3], [0, 1], [9, 4, 5, 9]) == [1 + 4, 2 + 3 + 4]


@pytest.mark.parametrize(
    "costs, parts, message",
    [([1, 2], 3, "Cannot split 2 items"), ([1], 0, "at least 1"), ([-1, 2], 1, "non-negative")],
)
def test_errors(costs, parts, message):
    with pytest.raises(ValueError, match=message):
        split_contiguous(costs, parts)


def test_large_inputs_are_handled_quickly_without_recursion():
    costs = np.random.default_rng(0).random(20000)
    starts = split_contiguous(costs, 16)
    assert len(starts) == 16
    total = costs.sum()
    assert max(stage_costs(costs, starts)) < total / 16 + costs.max()


def test_no_stage_begins_at_a_forbidden_position():
    costs = [1.0, 5.0, 1.0, 1.0, 5.0, 1.0]
    assert split_between(costs, 2) == [0, 3]  # the cheapest split, without constraints
    starts = split_between(costs, 2, forbidden=[2, 3])
    assert starts[0] == 0 and starts[1] not in (2, 3)
    with pytest.raises(ValueError, match="places to cut"):
        split_between(costs, 3, forbidden=[1, 2, 3, 4])
