"""How a stage's optimizer update runs, as data: one pure decision, table-tested
(`tests/test_update_plan.py`).

`Update.run` executes any plan the same way: regularization, the loss-scale agreement, the
clipping, then one compiled optimizer call per group. What differs between a whole stage, its
flat gradients, its update in groups, a segment and ZeRO-1's slices is only this data.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyparflow import sizes
from hyparflow.engine.gradients.clipping import RANKS, Clipping
from hyparflow.engine.weights import byte_groups

# Bytes of variables per compiled optimizer call of a grouped update (hyparflow/sizes.py).
GROUP_BYTES = sizes.UPDATE_GROUP_BYTES

# Where the model's regularization (the value the step reports) comes from:
FIRST = "first"  # the call that makes the regularization gradients, before the update
CALL = "call"  # the one compiled update call, which adds the gradients itself
APART = "apart"  # a call of its own before the groups, which add the gradients themselves


@dataclass(frozen=True)
class UpdatePlan:
    """One step's update.

    - `groups`: positions (of the variables updated) per compiled optimizer call, in order;
      the gradients handed to `Update.run` come in this order, and each group's are let go
      once it is applied.
    - `flat`: the gradients arrive as `[flat tensor, *tables]`, split into views inside the
      one call.
    - `regularize_first`: the regularization gradients are added before the loss-scale
      agreement and the clipping, which count them; else inside each group's call.
    - `value`: where the model's regularization comes from (`FIRST`, `CALL`, `APART`), summed
      over the pipeline; None: the caller counts it (an update by segment).
    - `agree_finite`: every rank agrees on skipping an overflowing loss-scaled step.
    - `clip_shards`: tensor and expert shards clipped by their whole variables' norms.
    - `norm_over`: the global norm computed before the calls and clipped by (`clipping.STAGE`
      or `RANKS`); None: no global clipping, or Keras's own inside the one call.
    - `reset_step`: the optimizer's step counter is set to the step's before every group, so
      that each group sees the step one `apply` of all would.
    """

    groups: tuple[tuple[int, ...], ...]
    flat: bool = False
    regularize_first: bool = False
    value: str | None = None
    agree_finite: bool = False
    clip_shards: bool = False
    norm_over: str | None = None
    reset_step: bool = False


def update_groups(variables, group_bytes: int | None = None) -> list[list[int]]:
    """Positions of `variables` in `weights.byte_groups` of about `group_bytes` (default
    `GROUP_BYTES`).

    Example:
        >>> import numpy as np
        >>> kernels = [np.zeros(2**20, np.float32) for _ in range(5)]  # 4 MiB each
        >>> update_groups(kernels)  # groups close at 8 MiB
        [[0, 1], [2, 3], [4]]
    """
    position = {id(v): i for i, v in enumerate(variables)}
    groups = byte_groups(variables, GROUP_BYTES if group_bytes is None else group_bytes)
    return [[position[id(v)] for v in group] for group in groups]


def plan_update(
    groups: list[list[int]],
    *,
    clipping: Clipping,
    applies_per_variable: bool,
    regularized: bool,
    loss_scaling: bool,
    flat: bool = False,
    partitioned: bool = False,
    split_variables: bool = False,
) -> UpdatePlan:
    """A stage's update after its gradients are reduced, from facts about it (no TensorFlow).

    - `groups`: its variables' positions in update groups (`update_groups`; none: nothing to
      update).
    - `clipping`: the optimizer's (`clipping.decide_clipping`).
    - `applies_per_variable`: each variable's update reads only its own gradient, state and
      the step (`update.applies_per_variable`).
    - `regularized`, `loss_scaling`: it owns a regularized variable; a LossScaleOptimizer.
    - `flat`: its reduced gradients are one flat tensor beside the tables' row slices.
    - `partitioned`, `split_variables`: the model is cut into pipeline stages; the stage holds
      tensor or expert shards.

    In groups where there are several, the optimizer allows it and no norm needs the
    regularization gradients first (memory: one group's temporaries at a time); else flat in
    one call where nothing clips over ranks (speed: one call splits, regularizes and applies);
    else a list in one call.

    Example:
        >>> plan_update([[0, 1]], clipping=Clipping(), applies_per_variable=True,
        ...             regularized=True, loss_scaling=False, flat=True).value
        'call'
    """
    everything = (tuple(i for group in groups for i in group),) if groups else ()
    if (
        len(groups) > 1
        and applies_per_variable
        and not clipping.shards_by_whole_variable
        and not (clipping.by_global_norm and regularized)
    ):
        return UpdatePlan(
            tuple(map(tuple, groups)),
            value=APART,
            norm_over=clipping.global_norm_over,
            reset_step=True,
        )
    across_ranks = clipping.global_norm_over == RANKS
    if flat and not across_ranks and not split_variables:
        return UpdatePlan(
            everything, flat=True, value=CALL, agree_finite=partitioned and loss_scaling
        )
    return UpdatePlan(
        everything,
        regularize_first=True,
        value=FIRST,
        agree_finite=loss_scaling,
        clip_shards=clipping.shards_by_whole_variable,
        norm_over=RANKS if across_ranks else None,
    )


def plan_segment(groups: list[list[int]]) -> UpdatePlan:
    """One segment's update during the backward (`SegmentUpdate`): group by group at the
    step's counter, regularization added in each call and counted by the caller (once, before
    any segment changes the weights). No loss scaling or global clipping waits for it
    (`SegmentUpdate.usable`).

    Example:
        >>> plan_segment([[3, 4], [5]])
        UpdatePlan(groups=((3, 4), (5,)), flat=False, regularize_first=False, value=None, \
agree_finite=False, clip_shards=False, norm_over=None, reset_step=True)
    """
    return UpdatePlan(tuple(map(tuple, groups)), reset_step=True)


def plan_sharded(targets: int, *, clipping: Clipping, loss_scaling: bool) -> UpdatePlan:
    """ZeRO-1's update of a step's `targets` (this replica's slices, then the tables and expert
    shards kept whole) in one call: regularization first, every rank agreeing on a loss-scale
    overflow (each sees only its slice), clipped by the whole model's norm, which a slice
    alone cannot give (`ShardedUpdate`).

    Example:
        >>> plan_sharded(2, clipping=Clipping(), loss_scaling=True).groups
        ((0, 1),)
    """
    return UpdatePlan(
        (tuple(range(targets)),) if targets else (),
        regularize_first=True,
        value=FIRST,
        agree_finite=loss_scaling,
        norm_over=clipping.global_norm_over,
    )
