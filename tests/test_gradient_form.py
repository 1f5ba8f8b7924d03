"""The one rule that picks a stage's gradient form (flat, per variable, overlapped)."""

import pytest

from hyparflow.engine.gradients.form import GradientForm, choose_gradient_form, segments_for

LIST = GradientForm()
FLAT = GradientForm(flat=True)
FLAT_BACKWARD = GradientForm(flat=True, flat_backward=True)
OVERLAP = GradientForm(overlap=True)
BY_SEGMENT = GradientForm(update_per_segment=True)

# A stage of 4 dense float32 variables of small mean size, no tables, nothing shared, MPI.
BASE = dict(
    replicas=1,
    backend="mpi",
    flat_gradients=True,
    dense_variables=4,
    all_float32=True,
    large_variables=False,
    shared_across_stages=False,
    tables=0,
    overlap_groups=1,
)

CASES = {
    # the whole model is the stage (data parallelism, or the engine on one rank)
    "whole, one replica: nothing to reduce": (False, {}, LIST),
    "whole, replicas over MPI": (False, {"replicas": 2}, FLAT),
    "whole, replicas, large variables too": (False, {"replicas": 2, "large_variables": True}, FLAT),
    "whole, replicas, embedding tables beside": (False, {"replicas": 2, "tables": 1}, FLAT),
    "whole, Horovod takes a list": (False, {"replicas": 2, "backend": "horovod"}, LIST),
    "whole, flat_gradients=False": (False, {"replicas": 2, "flat_gradients": False}, LIST),
    "whole, no dense variable": (False, {"replicas": 2, "dense_variables": 0}, LIST),
    "whole, a variable not float32": (False, {"replicas": 2, "all_float32": False}, LIST),
    # pipeline stages
    "stage, small variables": (True, {}, FLAT_BACKWARD),
    "stage, small variables, replicas": (True, {"replicas": 2}, FLAT_BACKWARD),
    "stage, large variables, one replica": (True, {"large_variables": True}, LIST),
    "stage, large variables, replicas": (True, {"replicas": 2, "large_variables": True}, FLAT),
    "stage, shared with another stage": (True, {"shared_across_stages": True}, LIST),
    "stage, shared, replicas": (True, {"replicas": 2, "shared_across_stages": True}, LIST),
    "stage, Horovod with replicas": (True, {"replicas": 2, "backend": "horovod"}, LIST),
    "stage, Horovod, one replica": (True, {"backend": "horovod"}, FLAT_BACKWARD),
    "stage, flat_gradients=False": (True, {"flat_gradients": False}, LIST),
    "stage, no dense variable": (True, {"dense_variables": 0}, LIST),
    "stage, a variable not float32": (True, {"all_float32": False}, LIST),
    "stage, tables beside small variables": (True, {"tables": 2}, FLAT_BACKWARD),
    # a variable's row slices not classified before training would turn dense in a packed
    # backward unseen: each gradient apart, where they are refused
    "stage, row-sparse variables unclassified": (True, {"rows_classified": False}, FLAT),
    # overlap_groups > 1
    "overlap, whole model with replicas": (False, {"replicas": 2, "overlap_groups": 3}, OVERLAP),
    "overlap, stage with replicas": (True, {"replicas": 2, "overlap_groups": 3}, OVERLAP),
    "overlap wins over flat_gradients=False": (
        True,
        {"replicas": 2, "overlap_groups": 2, "flat_gradients": False},
        OVERLAP,
    ),
    # one replica: nothing to reduce, each segment's update applied once its backward ends
    "segments, stage with one replica": (True, {"overlap_groups": 3}, BY_SEGMENT),
    "segments, stage with one replica, large variables": (
        True,
        {"overlap_groups": 2, "large_variables": True},
        BY_SEGMENT,
    ),
    "segments, whole model with one replica: one call": (False, {"overlap_groups": 3}, LIST),
    "segments, tensor shards": (True, {"overlap_groups": 3, "tensor_split": True}, FLAT_BACKWARD),
    "segments, shared layer": (True, {"overlap_groups": 3, "shared_across_stages": True}, LIST),
    "segments, tables": (True, {"overlap_groups": 3, "tables": 1}, FLAT_BACKWARD),
    # segments called for by the gradient bytes (segments_for)
    "segments by bytes, stage": (True, {"segments": 4}, BY_SEGMENT),
    "segments by bytes, whole model with replicas": (
        False,
        {"replicas": 2, "segments": 4},
        BY_SEGMENT,
    ),
    "segments by bytes, stage with replicas": (True, {"replicas": 2, "segments": 2}, BY_SEGMENT),
    "segments by bytes, replicas, a variable not float32": (
        False,
        {"replicas": 2, "segments": 4, "all_float32": False},
        LIST,
    ),
    "segments by bytes, Horovod": (
        False,
        {"replicas": 2, "segments": 4, "backend": "horovod"},
        LIST,
    ),
    "segments by bytes, shared layer": (True, {"segments": 4, "shared_across_stages": True}, LIST),
    "overlap asked for wins over segments by bytes": (
        True,
        {"replicas": 2, "overlap_groups": 3, "segments": 4},
        OVERLAP,
    ),
    "overlap, Horovod": (True, {"replicas": 2, "overlap_groups": 3, "backend": "horovod"}, LIST),
    "overlap, shared layer (its pipeline sum first)": (
        True,
        {"replicas": 2, "overlap_groups": 3, "shared_across_stages": True},
        LIST,
    ),
    "overlap, embedding tables (segments keep gradients dense)": (
        False,
        {"replicas": 2, "overlap_groups": 3, "tables": 1},
        FLAT,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_gradient_form(case):
    partitioned, changes, expected = CASES[case]
    assert choose_gradient_form(partitioned=partitioned, **{**BASE, **changes}) == expected


def test_a_stage_that_cannot_be_cut_asks_again_without_overlap():
    facts = dict(BASE, replicas=2, large_variables=True)
    assert choose_gradient_form(partitioned=True, **{**facts, "overlap_groups": 3}) == OVERLAP
    assert choose_gradient_form(partitioned=True, **facts) == FLAT  # the fallback


def test_flat_backward_only_with_flat():
    for partitioned, changes, _ in CASES.values():
        form = choose_gradient_form(partitioned=partitioned, **{**BASE, **changes})
        assert not form.flat_backward or (form.flat and partitioned)
        assert not (form.overlap and form.flat)


def test_segments_follow_gradient_bytes():
    mib = 2**20
    assert segments_for(31 * mib) == 1  # below two segments' bytes: one call
    assert [segments_for(n * 16 * mib) for n in (2, 4, 8, 20)] == [2, 4, 8, 8]
