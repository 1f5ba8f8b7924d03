"""The form a stage's gradients take (flat tensor, per variable, overlapped), chosen by one rule."""

from __future__ import annotations

from dataclasses import dataclass

from hyparflow import sizes


@dataclass(frozen=True)
class GradientForm:
    """How a stage keeps and reduces its gradients.

    - `flat`: the dense gradients are summed as one aligned float32 tensor (`FlatLayout`),
      reduced across replicas by one `reduce_flat` and applied by one compiled update.
    - `flat_backward` (pipeline stages, with `flat`): each micro-batch's backward already
      yields that flat tensor; without it gradients are summed per variable and concatenated
      once per step, just before the replica reduction.
    - `overlap`: the stage runs as segments whose gradients are reduced during the backward.
    - `update_per_segment`: the stage runs as segments, and each segment's update is applied
      as soon as the step's last backward has finished it (its gradients first summed over
      the replicas, if any), so the stage never holds all of its gradients
      (engine/gradients/segment_update.py).
    """

    flat: bool = False
    flat_backward: bool = False
    overlap: bool = False
    update_per_segment: bool = False


# Segments of `update_per_segment` (`segments_for`); why these sizes: hyparflow/sizes.py.
SEGMENT_BYTES = sizes.SEGMENT_BYTES


def segments_for(gradient_bytes: int, gathered: bool = False) -> int:
    """Segments a stage's backward is cut into so that it updates segment by segment: one per
    `SEGMENT_BYTES` of gradients, at most `sizes.most_segments(gathered)` (1: not cut;
    `gathered`: ZeRO-3 gathers each whole, and allows more).

    Example:
        >>> segments_for(64 * 2**20), segments_for(20 * 2**20), segments_for(2**30)
        (4, 1, 8)
        >>> segments_for(2**30, gathered=True)
        32
    """
    return max(1, min(sizes.most_segments(gathered), gradient_bytes // SEGMENT_BYTES))


def choose_gradient_form(
    *,
    partitioned: bool,
    replicas: int,
    backend: str = "mpi",
    flat_gradients: bool = True,
    dense_variables: int,
    all_float32: bool = True,
    large_variables: bool = False,
    shared_across_stages: bool = False,
    tables: int = 0,
    rows_classified: bool = True,
    overlap_groups: int = 1,
    segments: int = 1,
    tensor_split: bool = False,
    expert_split: bool = False,
    shard_gradients: bool = False,
) -> GradientForm:
    """The gradient form of one stage, from facts about it (no TensorFlow, no MPI).

    - `partitioned`: the model is cut into pipeline stages (else the whole model is the stage,
      and its forward, loss and gradients run as one compiled call).
    - `replicas`: replicas of the stage that sum its gradients; `backend` sums them ("mpi" or
      "horovod": Horovod's reducer takes a list, so its gradients are never flat).
    - `flat_gradients`: the strategy's switch (`hf.Strategy(flat_gradients=False)` keeps lists).
    - `dense_variables`, `all_float32`: the variables a flat tensor would hold (embedding
      tables' row slices stay apart), which must all be float32 for it to exist.
    - `large_variables`: they average more bytes than `FLAT_BACKWARD_MAX_MEAN_BYTES`, where a
      flat backward's per-micro-batch concat costs more than per-variable sums.
    - `shared_across_stages`: a variable of this stage is used by another stage too; those are
      summed per variable over the pipeline first, so the gradients stay a list.
    - `tables`: number of embedding tables (overlapped segments keep every gradient dense;
      ZeRO-2's segments keep their row slices whole, `shard_gradients`).
    - `rows_classified`: every variable with row-sparse gradients is known before training
      (engine/keras_semantics/sparse_probe.py). Otherwise no flat backward: it differentiates one
      packed tensor, where an unknown variable's row slices would turn dense unseen; per variable
      they show, and are refused.
    - `overlap_groups`: the strategy's segments per stage (> 1 asks for overlap, or without
      replicas for the update per segment).
    - `segments`: segments its gradient bytes call for (`segments_for`; > 1: update per
      segment, unless overlap was asked for).
    - `tensor_split`: the stage holds tensor-parallel shards (no update per segment).
    - `expert_split`: the stage holds expert shards, summed over other ranks than the rest:
      a list, reduced after the backward.
    - `shard_gradients`: ZeRO-2 over the replicas, which reduce-scatters segments and keeps
      tables whole (engine/gradients/segment_update.py).

    Overlap wins where it is asked for and applies (replicas to reduce over MPI, nothing
    shared, no tables); then the update per segment. The caller asks again with
    `overlap_groups=1, segments=1` when the stage cannot be cut into segments.

    Example:
        >>> choose_gradient_form(partitioned=False, replicas=2, dense_variables=4)
        GradientForm(flat=True, flat_backward=False, overlap=False, update_per_segment=False)
        >>> choose_gradient_form(partitioned=True, replicas=1, dense_variables=4,
        ...                      large_variables=True).flat
        False
        >>> choose_gradient_form(partitioned=True, replicas=1, dense_variables=4,
        ...                      overlap_groups=4).update_per_segment
        True
    """
    if expert_split:
        return GradientForm()
    mpi = backend == "mpi"
    can_cut = not shared_across_stages and (not tables or shard_gradients)
    if can_cut and overlap_groups > 1 and replicas > 1 and mpi:
        return GradientForm(overlap=True)
    # with replicas, each segment is summed over them as one flat float32 tensor, over MPI
    summable = (replicas == 1 and partitioned) or (replicas > 1 and mpi and all_float32)
    if can_cut and max(overlap_groups, segments) > 1 and not tensor_split and summable:
        return GradientForm(update_per_segment=True)
    can_flatten = flat_gradients and dense_variables > 0 and all_float32
    if not partitioned:
        # One compiled call sums the micro-batches either way: flat only for an MPI reduction.
        return GradientForm(flat=can_flatten and mpi and replicas > 1)
    if not can_flatten or shared_across_stages or (not mpi and replicas > 1):
        return GradientForm()
    if not large_variables:
        return GradientForm(flat=True, flat_backward=rows_classified)
    # Large variables: summed per variable, flattened once per step only to be reduced.
    return GradientForm(flat=replicas > 1)
