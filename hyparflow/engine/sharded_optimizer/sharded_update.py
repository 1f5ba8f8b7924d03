"""ZeRO-1: each of a stage's R replicas keeps and updates 1/R of the stage's optimizer state.

`Strategy(shard_optimizer=True)` (docs/zero.md). A step's gradients are reduce-scattered over
the stage's replicas (`topology.stage_comm`, one per stage and tensor shard) instead of
all-reduced: replica r receives the sum of its slice of the stage's flattened gradient
(`layout.SliceLayout`), adds the regularization gradients of that slice, clips by the
whole model's norm (squares summed over replicas, tensor ranks and stages), and runs the user's
optimizer on one 1-D variable per dtype holding its slice of the parameters, so the optimizer
builds its slots for that slice alone. The updated slices are then all-gathered into every
replica's variables. Embedding tables stay whole: their row-sparse gradients are gathered as
without ZeRO and applied in the same optimizer call, because Keras's sparse update (Adam
squares each (row, value) pair) is not the update of the densified gradient. Where the stage
updates segment by segment (`SegmentUpdate`), each segment is a flat vector of its own, and
`apply_segment` runs all of this on one segment as soon as the last backward has finished it.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", stage 1 (optimizer state partitioning).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf
from keras.optimizers import LossScaleOptimizer

from hyparflow.comm.allreduce import DEFAULT_BUCKET_BYTES, reduction_dtype
from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.engine.gradients.flat import FlatLayout
from hyparflow.engine.gradients.mpi import mpi_op
from hyparflow.engine.gradients.update import apply_step, regularization_in_call
from hyparflow.engine.gradients.update_plan import plan_segment, plan_sharded
from hyparflow.engine.sharded_optimizer.layout import (
    SliceLayout,
    dense_segment_positions,
    group_by_dtype,
    ring_bytes,
)
from hyparflow.traced import traced

# Bytes of gradients reduce-scattered per MPI call (as the fused allreduce's buckets).
WINDOW_BYTES = DEFAULT_BUCKET_BYTES


class _DtypeSlice:
    """The stage's variables of one dtype (in one segment): their layout, this replica's
    extents, its slice, and the bytes a step sends for them."""

    def __init__(
        self, dtype: str, positions: list[int], variables: list, parts: int, part: int, name: str
    ):
        self.dtype = dtype
        self.positions = positions  # indices in the stage's variable list
        self.layout = SliceLayout([int(np.prod(variables[i].shape)) for i in positions], parts)
        self.extents = self.layout.extents(part)
        self.padding = self.layout.padding(part)
        self.variable = keras.Variable(
            np.zeros(self.layout.slice_size, dtype), trainable=True, name=name
        )
        self.slot_prefix = self.variable.path.replace("/", "_") + "_"  # Keras's slot names
        padded = self.layout.padded
        self.reduce_scatter_bytes = ring_bytes(padded, parts, self.reduced_dtype.itemsize)
        self.allgather_bytes = ring_bytes(padded, parts, np.dtype(dtype).itemsize)

    @property
    def reduced_dtype(self) -> np.dtype:
        return reduction_dtype(self.dtype)


def sliced_segments(
    variables, dense: list[int], segments, comm, prefix: str = "hyparflow_zero"
) -> list[list[_DtypeSlice]]:
    """The `_DtypeSlice`s of each segment of the `dense` positions (`segments`: lists of
    positions; None: one), this rank's of `comm`'s parts; their variables are named
    `prefix`, dtype and segment (each optimizer's slot names begin with them)."""
    sliced = []
    for k, members in enumerate(dense_segment_positions(dense, segments)):
        by_dtype = group_by_dtype([variables[i].dtype for i in members])
        name = "" if segments is None else f"_s{k}"
        sliced.append(
            [
                _DtypeSlice(
                    dtype,
                    [members[j] for j in positions],
                    variables,
                    comm.Get_size(),
                    comm.Get_rank(),
                    f"{prefix}_{dtype}{name}",
                )
                for dtype, positions in by_dtype.items()
            ]
        )
    return sliced


def windowed_reduce_scatter(comm, group, views: list, scale: float, guard) -> np.ndarray:
    """This replica's slice of the sum of `views` (`group`'s flattened gradients, in its
    positions' order, each replica's times its `scale`) over the replicas of `comm`,
    reduce-scattered window by window: each call sends every replica its next `window`
    elements, so the buffers hold about WINDOW_BYTES, never a second copy of the gradients (nor
    the whole-size temporary MPI's reduce-then-scatter keeps on one rank); `guard(operation)`
    watches each wait. The engine's step calls it (`ShardedUpdate`), a model's own step inside
    its graph (`in_step.SlicedApply`), and a layer's backward under ZeRO-3 on a stage not cut
    into segments (`layer_gathering.LayerGathering`)."""
    layout, parts = group.layout, comm.Get_size()
    dtype = group.reduced_dtype
    window = max(1, WINDOW_BYTES // (parts * dtype.itemsize))
    received = np.empty(layout.slice_size, dtype)
    buffer = np.empty(parts * min(window, layout.slice_size), dtype)
    for first in range(0, layout.slice_size, window):
        count = min(window, layout.slice_size - first)
        send = buffer[: parts * count].reshape(parts, count)  # contiguous: no copy for MPI
        for part in range(parts):
            row = send[part]
            row[:] = 0  # the padding
            start = layout.bounds(part)[0] + first
            for j, begin, size in layout.element_ranges(start, start + count):
                position = layout.offsets[j] + begin - start
                row[position : position + size] = views[j][begin : begin + size]
        if scale != 1.0:
            send *= scale
        with guard("reduce-scatter the gradients over the replicas"):
            comm.Reduce_scatter_block(send, received[first : first + count], op=mpi_op("SUM"))
    return received


class SliceGradients:
    """A step's gradients under ZeRO: this rank's own (`as_list`, for the finite check), the
    reduced slice of each dtype group (`slices`), the tables' gathered row slices and the
    expert shards' gradients summed over the ranks holding the same experts (`experts`)."""

    def __init__(self, local: list, slices: list, tables: list, experts: list = ()):
        self.local, self.slices, self.tables = local, slices, tables
        self.experts = list(experts)

    def as_list(self) -> list:
        return self.local

    def give_up(self) -> list:
        """What `ShardedUpdate.apply` steps, `[*slices, *tables, *experts]`, as their only
        reference: this object holds none of them after."""
        handed = [*self.slices, *self.tables, *self.experts]
        self.slices, self.tables, self.experts = [], [], []
        return handed


class ShardedUpdate:
    """The reduction and optimizer step of a stage whose optimizer state is split over its
    replicas (ZeRO-1), in place of `GradientSync.reduce` and `Update.apply`.

    `update` is the stage's `Update`, whose `run` steps this replica's slices with this object
    as its target (`plan_sharded`, a segment's `plan_segment`): its regularization, loss-scale
    agreement, sums over the pipeline and tensor ranks and compiled calls are the same, so the
    two paths cannot drift apart.
    `sync` is the stage's `GradientSync`, whose runner and pipeline sum of shared layers give
    each rank's own gradients, and whose `sparse` positions are the embedding tables (kept
    whole, their slots too), and whose `experts` positions are expert shards (expert
    parallelism: kept whole too, their gradients summed over `sync.expert_reducer`'s ranks and
    their squared norm over the expert group). `segments` (lists of variable positions, from
    `SegmentUpdate`):
    each is laid out and sliced apart, so that it can be updated alone as soon as the last
    backward has finished it (`apply_segment`); None: the stage's variables are one.
    `sliced`: the `sliced_segments` of `segments` made beforehand (ZeRO-3's `ShardedWeights`
    holds the weights in the same slice variables). `weights_sharded` (ZeRO-3): the slices
    are the weights between steps, so the update neither loads them from the stage's
    variables nor all-gathers its results into them.
    `sent_bytes` counts the bytes this rank has sent (ring volume of the reduce-scatters and
    all-gathers); `step_bytes` and `allreduce_bytes` give one step's, and what an allreduce
    of the same gradients would send.

    Example:
        sharded = ShardedUpdate(model, topology, variables, update, sync)
        reg_value = sharded.apply(sharded.reduce().give_up())
    """

    def __init__(
        self,
        model,
        topology,
        variables,
        update,
        sync,
        segments=None,
        sliced=None,
        weights_sharded=False,
    ):
        self.model, self.topology, self.variables = model, topology, variables
        self.weights_sharded = weights_sharded
        self.comm = topology.stage_comm
        self.update, self.sync, self._guard = update, sync, update.guard
        parts = self.comm.Get_size()
        self.table_positions = list(sync.sparse)
        self.tables = [variables[i] for i in self.table_positions]
        self.expert_positions = list(sync.experts)
        self.experts = [variables[i] for i in self.expert_positions]
        whole = set(self.table_positions) | set(self.expert_positions)
        dense = [i for i in range(len(variables)) if i not in whole]
        # one flat vector per dtype of each segment (a whole stage's dense variables by default)
        self.segments = sliced or sliced_segments(variables, dense, segments, self.comm)
        self.groups = [group for groups in self.segments for group in groups]
        # each segment's groups as positions in `groups`, what `Update.run` updates per call
        self._segment_indices = _positions_in_order(self.segments)
        # Keras's slot names of the variables updated whole: tables and expert shards
        self.table_prefixes = [
            (v.path.replace("/", "_") + "_", v) for v in [*self.tables, *self.experts]
        ]
        owned = {id(v) for v in update.owned}
        split = update.split_ids
        # which extents count in the global norm: each variable once over the pipeline (the
        # stage that owns it), tensor shards summed over the tensor ranks; each one's index in
        # `_squares`: 0 whole, 1 a tensor shard
        self._norm_extents = [
            [
                (p, int(id(variables[g.positions[p.variable]]) in split))
                for p in g.extents
                if id(variables[g.positions[p.variable]]) in owned
            ]
            for g in self.groups
        ]
        # per table, then expert shard: None where another stage owns it, else its index in
        # `_squares` (2 a whole table, 3 a tensor-split one, 4 an expert shard)
        self._table_norm = [(2 + (id(v) in split)) if id(v) in owned else None for v in self.tables]
        self._table_norm += [4 if id(v) in owned else None for v in self.experts]
        self.sent_bytes = 0
        self.step_bytes = {
            "reduce_scatter": sum(g.reduce_scatter_bytes for g in self.groups),
            "allgather": sum(g.allgather_bytes for g in self.groups),
        }
        self.allreduce_bytes = sum(
            2 * ring_bytes(g.layout.length, parts, g.reduced_dtype.itemsize) for g in self.groups
        )
        self._regularize_fn = traced(self._regularize, reduce_retracing=True)
        self._squares_fn = traced(self._squares, reduce_retracing=True)
        self._built_for = None

    @property
    def optimizer(self):
        """The optimizer that steps these slices: the model's compiled one."""
        return self.model.optimizer

    # --- the reduction -----------------------------------------------------------------------
    def reduce(self, keep_local: bool = False) -> SliceGradients:
        """Take this rank's gradients (summed over stages sharing a layer) and reduce-scatter
        them over the stage's replicas: each receives the sums of its slice (collective).

        The gradients are read where they lie (views of the runner's tensors) and sent window
        by window, so the step holds them once (`keep_local`: keep them after, for the
        trainer's finite check). A runner whose backward gave the slices already
        (`slice_gradients`: ZeRO-3's `LayerGathering`) hands them over as they are."""
        if self.sync.runner.slice_gradients:
            return self._slices_from_backward(keep_local)
        local, tables = self._take_gradients()
        own_tables = tables
        if tables:  # row slices of every replica, in rank order, as without ZeRO
            tables = row_sparse.reduce_rows(self.comm, tables, self.sync.tables_per_batch)
        kept = None
        if keep_local:
            kept = list(local)
            for i, table in zip(self.table_positions, own_tables, strict=True):
                kept[i] = table
        experts = [tf.convert_to_tensor(local[i]) for i in self.expert_positions]
        if experts and self.sync.expert_reducer is not None:
            experts = self.sync.expert_reducer.reduce(experts)
        slices = []
        for group in self.groups:
            views = [np.asarray(local[i]).reshape(-1) for i in group.positions]  # no copies
            slices.append(_as_slice(self._reduce_scatter(group, views), group))
        local = views = None  # the gradients' memory can go
        self.sent_bytes += self.step_bytes["reduce_scatter"]
        return SliceGradients(kept, slices, tables, experts)

    def _slices_from_backward(self, keep_local: bool) -> SliceGradients:
        """The slices the runner's backward reduce-scattered, and the tables' row slices of
        every replica; `keep_local`: each variable's elements in this replica's slices, for
        the finite check (each element is checked on the replica holding it)."""
        runner = self.sync.runner
        slices = runner.take_slice_gradients()  # in their groups' dtypes
        tables = runner.take_sparse_gradients()
        kept = self._elements_by_variable(slices, tables) if keep_local else None
        if tables:
            tables = row_sparse.reduce_rows(self.comm, tables, self.sync.tables_per_batch)
        return SliceGradients(kept, slices, tables)

    def _elements_by_variable(self, slices: list, tables: list) -> list:
        """Per variable, its elements in this replica's `slices` (the tables' own gradients)."""
        parts = [[] for _ in self.variables]
        for group, values in zip(self.groups, slices, strict=True):
            for p in group.extents:
                parts[group.positions[p.variable]].append(values[p.offset : p.offset + p.size])
        kept = [tf.concat(found, 0) if found else tf.zeros([0]) for found in parts]
        for i, table in zip(self.table_positions, tables, strict=True):
            kept[i] = table
        return kept

    def _reduce_scatter(self, group, views: list) -> np.ndarray:
        return windowed_reduce_scatter(self.comm, group, views, 1.0, self._guard)

    def _take_gradients(self) -> tuple[list, list]:
        """(each variable's gradient, None for tables; the tables' row slices). Flat gradients
        are read as views of their flat tensors (no per-variable copies of a whole model)."""
        sync, runner = self.sync, self.sync.runner
        layout = runner.layout
        if sync.shared is not None or layout is None:
            local = runner.take_gradients()
            if sync.shared is not None:
                local = sync.shared.sum(local, sync.shared_reducer, self.topology.pipeline_comm)
            tables = [local[i] for i in self.table_positions]
            return [None if i in self.table_positions else g for i, g in enumerate(local)], tables
        flat = runner.take_flat_gradients()
        tables = runner.take_sparse_gradients()
        parts = (
            [(layout, range(len(layout.slots)), flat)]
            if isinstance(layout, FlatLayout)
            else (list(zip(layout.buckets, layout.members, flat, strict=True)))
        )
        del flat
        local = [None] * len(self.variables)
        dense = sync.dense
        for chunk, members, tensor in parts:
            values = np.asarray(tensor)
            for slot, k in zip(chunk.slots, members, strict=True):
                local[dense[k]] = values[slot.offset : slot.offset + slot.size]
        return local, tables

    # --- the update --------------------------------------------------------------------------
    def apply(self, grads: list) -> float:
        """Step the optimizer on this replica's slices (`grads`, handed over by
        `SliceGradients.give_up`) and all-gather the new parameters into every replica's
        variables; return the model's total regularization (collective)."""
        plan = plan_sharded(
            len(self.groups) + len(self.tables) + len(self.experts),
            clipping=self.update.clipping(),
            loss_scaling=isinstance(self.model.optimizer, LossScaleOptimizer),
        )
        return self.update.run(plan, grads, target=self)

    # --- this replica's slices as the target of `Update.run` ----------------------------------
    def regularize(self, grads: list, scale: float) -> tuple:
        """(`grads` plus this slice of the regularization gradients, its whole and split
        parts)."""
        count = len(self.groups)
        slices, tables, whole, parts = self._regularize_fn(
            grads[:count], grads[count:], tf.constant(scale, tf.float32)
        )
        return [*slices, *tables], whole, parts

    def global_norm(self, grads: list, over: str, scale: float):
        count = len(self.groups)
        return self._global_norm(grads[:count], grads[count:], scale)

    def update_body(self, grads, scale, norm=None, *, group, flat, regularize):
        """The update of the targets at `group` (slices, then whole tables and expert shards),
        compiled: the slices loaded from the stage's variables, their regularization gradients
        added if `regularize`, clipped by the whole model's `norm` if given, then the
        optimizer's step; the new slice values."""
        groups, whole = self._targets_at(group)
        if not self.weights_sharded:  # else the slices are the weights
            self.load_slices(groups)
        slices, kept = list(grads[: len(groups)]), list(grads[len(groups) :])
        if regularize:
            slices = self._regularized_slices(groups, slices, scale)
            kept = self._regularized_whole(whole, kept, scale)
        variables = [g.variable for g in groups] + whole
        apply_step(self.model.optimizer, slices + kept, variables, norm)
        return [g.variable.value for g in groups]

    def after_update(self, group, output) -> None:
        """Give every replica the parameters the call updated (ZeRO-3: each keeps its slice)."""
        if not self.weights_sharded:
            self._gather(output, self._targets_at(group)[0])

    def _targets_at(self, group) -> tuple[list, list]:
        """(the slice groups, the tables and expert shards) at positions `group` of
        `_targets()`."""
        count, kept_whole = len(self.groups), [*self.tables, *self.experts]
        return [self.groups[i] for i in group if i < count], [
            kept_whole[i - count] for i in group if i >= count
        ]

    def _regularized_slices(self, groups, slices, scale) -> list:
        """`slices` of `groups` plus their regularization gradients (inside the call)."""
        members = {id(self.variables[i]) for g in groups for i in g.positions}
        regularized = [v for v in self.update.regularized if id(v) in members]
        _, by_variable = regularization_in_call(regularized)
        if not by_variable:
            return slices
        return [
            self._plus_regularization(g, s, by_variable, scale)
            for g, s in zip(groups, slices, strict=True)
        ]

    def _regularized_whole(self, variables, grads, scale) -> list:
        """`grads` of whole `variables` (tables) plus their regularization gradients, dense
        where there are some, as one process's tape sums them (inside the call)."""
        members = {id(v) for v in variables}
        regularized = [v for v in self.update.regularized if id(v) in members]
        _, by_variable = regularization_in_call(regularized)
        return [
            _plus_dense(grad, by_variable.get(id(variable)), scale)
            for variable, grad in zip(variables, grads, strict=True)
        ]

    def _regularize(self, slices, tables, scale):
        """`slices` plus this slice of the regularization gradients (times the loss scale, as
        the stage's gradients are of the scaled loss), `tables` plus theirs (dense, as one
        process's tape sums them); the regularization's two parts."""
        whole, parts, reg_grads = self.update.regularization_and_grads()
        by_variable = {id(v): g for v, g in zip(self.update.regularized, reg_grads, strict=True)}
        added = [
            self._plus_regularization(group, grad, by_variable, scale)
            for group, grad in zip(self.groups, slices, strict=True)
        ]
        tables = [
            _plus_dense(grad, by_variable.get(id(table)), scale)
            for table, grad in zip([*self.tables, *self.experts], tables, strict=True)
        ]
        return added, tables, whole, parts

    def _plus_regularization(self, group, grad, by_variable: dict, scale):
        """`grad`, the slice of `group`, plus the slice of its variables' regularization
        gradients `by_variable` (id -> gradient) times `scale`."""
        extents = []
        for p in group.extents:
            reg = by_variable.get(id(self.variables[group.positions[p.variable]]))
            if reg is None:
                extents.append(tf.zeros([p.size], group.dtype))
            else:
                flat = tf.reshape(tf.convert_to_tensor(reg), [-1])[p.start : p.stop]
                extents.append(tf.cast(flat, group.dtype))
        if group.padding:
            extents.append(tf.zeros([group.padding], group.dtype))
        if not extents:
            return grad
        return grad + tf.concat(extents, axis=0) * tf.cast(scale, group.dtype)

    def _squares(self, slices, tables, scale):
        """Squared norms, unscaled, of the owned extents of `slices` and of the owned `tables`
        and expert shards (a table's each (row, value) pair counts, as in Keras), by where they
        are summed: (whole variables, tensor shards, whole tables, split tables, experts)."""
        sums = [tf.constant(0.0)] * 5
        for grad, at in zip(tables, self._table_norm, strict=True):
            if at is not None:
                sums[at] += tf.reduce_sum(tf.square(tf.cast(row_sparse.values_of(grad), "float32")))
        for grad, extents in zip(slices, self._norm_extents, strict=True):
            for p, at in extents:
                part = grad[p.offset : p.offset + p.size]
                sums[at] += tf.reduce_sum(tf.square(tf.cast(part, "float32")))
        return tf.stack(sums) / tf.square(scale)

    def _global_norm(self, slices, tables, scale: float):
        """Keras's global gradient norm of the whole model: slices' squares summed over the
        stage's replicas, shards' over the tensor ranks, stages' over the pipeline. Every
        replica holds the tables' whole gradients: they count once, after the replica sum; the
        expert shards' are summed over the expert group (each holds other experts)."""
        squares = np.asarray(
            self._squares_fn(slices, tables, tf.constant(scale, tf.float32)), np.float64
        )
        replicas = np.ascontiguousarray(squares[:2])
        with self._guard("sum the gradient norm over the replicas"):
            self.comm.Allreduce(mpi_op("IN_PLACE"), replicas)
        whole, split = float(replicas[0] + squares[2]), float(replicas[1] + squares[3])
        if self.experts:
            with self._guard("sum the gradient norm over the expert group"):
                whole += self.update.expert_comm.allreduce(float(squares[4]))
        if self.update.tensor_comm is not None:
            with self._guard("sum the gradient norm over the tensor ranks"):
                split = self.update.tensor_comm.allreduce(split)
        with self._guard("sum the gradient norm over the pipeline"):
            total = self.topology.pipeline_comm.allreduce(whole + split)
        return tf.constant(math.sqrt(total), tf.float32)

    def load_slices(self, groups=None) -> None:
        """Each slice variable (of `groups`, default all) takes its elements of the stage's
        variables, which are the truth between steps (restores, callbacks and tensor shards
        write those)."""
        load_slices(self.groups if groups is None else groups, self.variables)

    def _targets(self) -> list:
        return [g.variable for g in self.groups] + self.tables + self.experts

    def _gather(self, values, groups=None) -> None:
        """Give every replica the updated parameters (of `groups`, default all): each
        variable's extents are broadcast by the replicas that hold them, through one buffer the
        size of the largest variable, so no rank holds a second copy of the whole stage."""
        groups = self.groups if groups is None else groups
        for group, value in zip(groups, values, strict=True):
            mine = np.asarray(value)
            held = {p.variable: p for p in group.extents}  # this replica's extent of each
            buffer = np.empty(max(group.layout.sizes), mine.dtype)
            for j, i in enumerate(group.positions):
                variable = self.variables[i]
                size = group.layout.sizes[j]
                for owner, (start, stop) in group.layout.holders(j):
                    if owner == self.comm.Get_rank():
                        extent = held[j]
                        buffer[start:stop] = mine[extent.offset : extent.offset + extent.size]
                    with self._guard("all-gather the updated parameters", peer=owner):
                        # bytes, so that any dtype travels (MPI has no float16 or bfloat16)
                        self.comm.Bcast(buffer[start:stop].view(np.uint8), root=owner)
                variable.assign(buffer[:size].reshape(tuple(variable.shape)))
            self.sent_bytes += group.allgather_bytes

    # --- the update of one segment, during the last backward ----------------------------------
    def apply_segment(self, k: int, grads: dict, step: int) -> None:
        """Segment k's update as soon as the last backward has finished it (`SegmentUpdate`):
        its gradients (`grads`, position -> gradient, let go here) reduce-scattered, then
        `step_segment`. Collective over the replicas. Only where no step-wide decision waits
        for every gradient: no loss scaling and no global clipping (`SegmentUpdate.usable`);
        tables are in no segment (ZeRO-2 steps them whole, `step_tables`)."""
        self.step_segment(k, self.scatter_segment(k, grads), step)

    def scatter_segment(self, k: int, grads: dict) -> list[np.ndarray]:
        """This replica's slices of segment k's gradients (`grads`, position -> gradient, let
        go here) summed over the replicas, one array per dtype group in the reduction dtype
        (collective)."""
        received = []
        for group in self.segments[k]:
            views = [np.asarray(grads.pop(i)).reshape(-1) for i in group.positions]
            received.append(self._reduce_scatter(group, views))
            views = None  # the segment's gradients can go
            self.sent_bytes += group.reduce_scatter_bytes
        return received

    def step_segment(self, k: int, received: list, step: int) -> None:
        """`Update.run` of segment k's `plan_segment` on its slices `received` (let go here):
        its regularization added, this replica's slices stepped at optimizer step `step`, the
        new parameters all-gathered."""
        slices = [_as_slice(r, g) for g, r in zip(self.segments[k], received, strict=True)]
        received.clear()
        plan = plan_segment([self._segment_indices[k]])
        self.update.run(plan, slices, target=self, step=step)

    def apply_received(self, received: list, tables=()) -> float:
        """ZeRO-2's update after the backward: this replica's slices of every group
        (`received`, in `groups` order, as `scatter_segment` gave them; let go here) and the
        tables' gathered row slices stepped as `apply` steps a step's (collective). Stages cut
        into segments have no expert shards."""
        if self.experts:
            raise ValueError("slices received by segment leave out expert shards")
        slices = [_as_slice(r, g) for g, r in zip(self.groups, received, strict=True)]
        received.clear()
        return self.apply([*slices, *tables])

    def reduce_tables(self, tables: list) -> list:
        """The tables' row slices (in `tables` order) of every replica, in rank order, as
        without ZeRO (collective)."""
        return row_sparse.reduce_rows(self.comm, tables, self.sync.tables_per_batch)

    def step_tables(self, tables: list, step: int) -> None:
        """ZeRO-2 by segment: the tables' gathered row slices stepped alone at optimizer step
        `step` (their regularization added in the call), kept whole."""
        count = len(self.groups)
        plan = plan_segment([list(range(count, count + len(self.tables)))])
        self.update.run(plan, list(tables), target=self, step=step)

    def build_optimizer(self) -> None:
        """Build the model's optimizer for the slice variables (once per optimizer object)."""
        optimizer = self.model.optimizer
        if self._built_for is optimizer:
            return
        if optimizer.built:
            raise ValueError(
                "shard_optimizer=True: the model's optimizer was already built for whole "
                "variables; compile the model again (a fresh optimizer) before hf.fit builds it "
                "for this replica's slice."
            )
        optimizer.build(self._targets())
        self._built_for = optimizer


def load_slices(groups: list, variables: list) -> None:
    """Each slice variable of `groups` takes its elements of `variables` (the positions'
    list), its padding zeros."""
    for group in groups:
        extents = [
            tf.reshape(variables[group.positions[p.variable]], [-1])[p.start : p.stop]
            for p in group.extents
        ]
        if group.padding:
            extents.append(tf.zeros([group.padding], group.dtype))
        group.variable.assign(tf.concat(extents, axis=0))


def _plus_dense(grad, reg, scale):
    """`grad` of a variable kept whole plus its regularization gradient `reg` (None: none)
    times `scale`, dense, as one process's tape sums them."""
    if reg is None:
        return grad
    grad = tf.convert_to_tensor(grad)
    return grad + tf.cast(reg, grad.dtype) * tf.cast(scale, grad.dtype)


def _as_slice(received: np.ndarray, group: _DtypeSlice):
    """A group's received sums as a tensor of its variables' dtype."""
    return tf.cast(tf.constant(received), group.dtype)


def _positions_in_order(lists: list[list]) -> list[list[int]]:
    """Each of `lists`' items as positions in their concatenation.

    Example:
        >>> _positions_in_order([["a", "b"], ["c"]])
        [[0, 1], [2]]
    """
    ends = np.cumsum([len(items) for items in lists]).tolist()
    return [list(range(end - len(items), end)) for items, end in zip(lists, ends, strict=True)]
