"""How a stage's optimizer update runs (engine/gradients/update_plan.py): one rule, as a table."""

import numpy as np
import pytest

from hyparflow.engine.gradients.clipping import RANKS, STAGE, Clipping
from hyparflow.engine.gradients.update_plan import (
    APART,
    CALL,
    FIRST,
    UpdatePlan,
    plan_segment,
    plan_sharded,
    plan_update,
    update_groups,
)

ONE, TWO = [[0, 1, 2]], [[0, 1], [2]]  # a stage's update groups: one, or two
EVERYTHING = ((0, 1, 2),)
NONE, PER_VARIABLE = Clipping(), Clipping(per_variable=True)
SHARDS = Clipping(per_variable=True, shards_by_whole_variable=True)
GLOBAL_STAGE, GLOBAL_RANKS = Clipping(global_norm_over=STAGE), Clipping(global_norm_over=RANKS)

LIST = UpdatePlan(EVERYTHING, regularize_first=True, value=FIRST)
FLAT = UpdatePlan(EVERYTHING, flat=True, value=CALL)
GROUPED = UpdatePlan(((0, 1), (2,)), value=APART, reset_step=True)

# groups, clipping, applies per variable, regularized, loss scaling, flat, partitioned, split
# -> the plan
TABLE = [
    # one group: one call, flat where the gradients are, else a list
    (ONE, NONE, True, False, False, False, False, False, LIST),
    (ONE, NONE, True, True, False, True, False, False, FLAT),
    # Keras clips a stage that is the whole model inside its one call
    (ONE, GLOBAL_STAGE, True, True, False, True, False, False, FLAT),
    (ONE, PER_VARIABLE, True, False, False, True, True, False, FLAT),
    # a norm over the ranks, or shards: a list, the norm computed first
    (ONE, GLOBAL_RANKS, True, False, False, True, True, False,
     UpdatePlan(EVERYTHING, regularize_first=True, value=FIRST, norm_over=RANKS)),
    (ONE, NONE, True, False, False, True, False, True, LIST),
    (ONE, SHARDS, True, False, False, False, False, True,
     UpdatePlan(EVERYTHING, regularize_first=True, value=FIRST, clip_shards=True)),
    # loss scaling: every rank agrees on an overflow; flat replicas of one stage see it alike
    (ONE, NONE, False, False, True, False, False, False,
     UpdatePlan(EVERYTHING, regularize_first=True, value=FIRST, agree_finite=True)),
    (ONE, NONE, False, False, True, True, False, False, FLAT),
    (ONE, NONE, False, False, True, True, True, False,
     UpdatePlan(EVERYTHING, flat=True, value=CALL, agree_finite=True)),
    # several groups: group by group, flat or not, the global norm first
    (TWO, NONE, True, True, False, False, False, False, GROUPED),
    (TWO, NONE, True, True, False, True, True, False, GROUPED),
    (TWO, GLOBAL_STAGE, True, False, False, True, False, False,
     UpdatePlan(((0, 1), (2,)), value=APART, norm_over=STAGE, reset_step=True)),
    (TWO, GLOBAL_RANKS, True, False, False, False, True, False,
     UpdatePlan(((0, 1), (2,)), value=APART, norm_over=RANKS, reset_step=True)),
    # ... unless the optimizer applies over all variables, a global norm must count the
    # regularization gradients, or shards are clipped by their whole variables first
    (TWO, NONE, False, False, False, True, False, False, FLAT),
    (TWO, GLOBAL_STAGE, True, True, False, True, False, False, FLAT),
    (TWO, GLOBAL_RANKS, True, True, False, False, True, False,
     UpdatePlan(EVERYTHING, regularize_first=True, value=FIRST, norm_over=RANKS)),
    (TWO, SHARDS, True, False, False, False, False, True,
     UpdatePlan(EVERYTHING, regularize_first=True, value=FIRST, clip_shards=True)),
    # nothing to update: no call
    ([], NONE, True, True, False, False, True, False,
     UpdatePlan((), regularize_first=True, value=FIRST)),
]  # fmt: skip


@pytest.mark.parametrize(
    "groups, clipping, per_variable, regularized, loss_scaling, flat, partitioned, split, plan",
    TABLE,
)
def test_the_update_plan_of_a_stage(
    groups, clipping, per_variable, regularized, loss_scaling, flat, partitioned, split, plan
):
    decided = plan_update(
        groups,
        clipping=clipping,
        applies_per_variable=per_variable,
        regularized=regularized,
        loss_scaling=loss_scaling,
        flat=flat,
        partitioned=partitioned,
        split_variables=split,
    )
    assert decided == plan


def test_a_segment_updates_group_by_group_and_leaves_the_regularization_to_its_caller():
    assert plan_segment([[3, 4], [5]]) == UpdatePlan(((3, 4), (5,)), reset_step=True)


@pytest.mark.parametrize(
    "targets, clipping, loss_scaling, plan",
    [
        (3, NONE, False, UpdatePlan(EVERYTHING, regularize_first=True, value=FIRST)),
        # a slice alone gives no norm of the model, even where the stage is all of it
        (
            3,
            GLOBAL_STAGE,
            True,
            UpdatePlan(
                EVERYTHING, regularize_first=True, value=FIRST, agree_finite=True, norm_over=STAGE
            ),
        ),
        (0, NONE, False, UpdatePlan((), regularize_first=True, value=FIRST)),
    ],
)
def test_zero_updates_its_slices_in_one_call(targets, clipping, loss_scaling, plan):
    assert plan_sharded(targets, clipping=clipping, loss_scaling=loss_scaling) == plan


def test_update_groups_close_at_the_group_size():
    kernels = [np.zeros(n, np.float32) for n in (4, 4, 1, 8)]  # 16, 16, 4, 32 bytes
    assert update_groups(kernels, group_bytes=32) == [[0, 1], [2, 3]]
    assert update_groups(kernels, group_bytes=0) == [[0], [1], [2], [3]]
    assert update_groups([]) == []
