"""A stage's optimizer update: regularization, loss scale, finite checks, clipping, one call."""

from __future__ import annotations

import functools
import math

import numpy as np
import tensorflow as tf
from keras import ops
from keras.optimizers import LossScaleOptimizer

from hyparflow import _keras
from hyparflow.comm.agree import AgreedError
from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.engine.gradients.clipping import RANKS, Clipping, decide_clipping
from hyparflow.engine.gradients.mpi import mpi_op
from hyparflow.engine.gradients.shard_clipping import ShardClipping
from hyparflow.engine.relaxed import rows_unknown
from hyparflow.engine.weights import byte_groups
from hyparflow.sizes import UPDATE_GROUP_BYTES
from hyparflow.traced import traced

# Bytes of variables per compiled optimizer call of a grouped update (hyparflow/sizes.py).
GROUP_BYTES = UPDATE_GROUP_BYTES


def update_groups(variables, group_bytes: int | None = None) -> list[list[int]]:
    """Positions of `variables` in `weights.byte_groups` of about `group_bytes` (default
    `GROUP_BYTES`).

    Example:
        >>> kernels = [np.zeros(2**20, np.float32) for _ in range(5)]  # 4 MiB each
        >>> update_groups(kernels)  # groups close at 8 MiB
        [[0, 1], [2, 3], [4]]
    """
    position = {id(v): i for i, v in enumerate(variables)}
    groups = byte_groups(variables, GROUP_BYTES if group_bytes is None else group_bytes)
    return [[position[id(v)] for v in group] for group in groups]


def applies_per_variable(optimizer) -> bool:
    """Whether Keras's `optimizer.apply` on groups of variables, the step counter put back
    between them, is one `apply` of all: each variable's update reads only its own gradient,
    state and the step. Not with loss scaling (one finite check per call, one scale update),
    moving averages or gradient accumulation (over all variables per call), or an optimizer
    that overrides `apply`."""
    return (
        not isinstance(optimizer, LossScaleOptimizer)
        and not getattr(optimizer, "use_ema", False)
        and not (getattr(optimizer, "gradient_accumulation_steps", None) or 0) > 1
        and _keras.applies_as_base_optimizer(optimizer)
    )


def apply_clipped(optimizer, grads, variables, norm) -> None:
    """`optimizer.apply` after Keras's `clip_by_global_norm` by `norm`, the whole model's
    gradient norm (a stage, a group or a slice alone would clip by its own). NaN if `norm` is
    not finite, as Keras's."""
    inner = inner_optimizer(optimizer)
    clip = inner.global_clipnorm
    scale = clip * ops.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
    inner.global_clipnorm = None
    try:
        # a table's row slices times the scale become dense, as in Keras's own clipping
        optimizer.apply([g * tf.cast(scale, g.dtype) for g in grads], variables)
    finally:
        inner.global_clipnorm = clip


def loss_scale(optimizer) -> float:
    """Keras's dynamic loss scale under mixed_float16 (a LossScaleOptimizer), else 1."""
    if isinstance(optimizer, LossScaleOptimizer):
        return float(optimizer.scale_loss(tf.constant(1.0)))
    return 1.0


class Update:
    """Apply a stage's reduced gradients to its variables as Keras's train step would.

    Adds the weight regularization of the variables the stage owns (`owned`: a variable
    shared by stages is regularized once), agrees across the pipeline on skipping a step
    whose loss-scaled gradients overflow, clips by the whole model's norm when the optimizer
    has `global_clipnorm` and the model is `partitioned`, and runs the optimizer as one
    compiled call. `guard(operation)` watches each blocking collective; `merge(dense, tables)`
    puts dense gradients and tables' row slices back in variable order; `layout` is the
    `FlatLayout` of flat gradients (None if they are a list). `split`: the tensor shards;
    `expert_split`: (expert shards, their expert group's communicator).

    ZeRO-1's `ShardedUpdate` (engine/sharded_optimizer/sharded_update.py) applies slices of the same
    gradients and builds on the public parts: `guard`, `split_ids` (ids of split variables),
    `tensor_comm`, `regularization_and_grads`, `total_regularization`, `sum_over_pipeline`,
    `agree_finite_for_loss_scaling` and `compiled_update`.
    """

    def __init__(
        self, model, topology, variables, owned, *, partitioned: bool, guard, merge, layout=None,
        split=(), expert_split=((), None),
    ):  # fmt: skip
        self.model = model
        self.topology = topology
        self.variables = variables
        self.owned = owned
        self._partitioned = partitioned
        self.guard = guard
        self._merge = merge
        self._layout = layout
        self.regularized = [v for v in owned if getattr(v, "regularizer", None)]
        # Tensor shards (`split`) and expert shards: their regularization and squared norms
        # are parts, summed over the tensor ranks or the expert group; every other variable is
        # whole on each of them.
        self.tensor_comm = topology.tensor_comm if split else None
        experts, expert_comm = expert_split
        self.expert_comm = expert_comm if experts else None  # the expert group (ZeRO-1 reads it)
        self.split_groups = [
            ({id(v) for v in shards}, comm)
            for shards, comm in ((split, self.tensor_comm), (experts, expert_comm))
            if shards
        ]
        self.split_ids = {i for ids, _ in self.split_groups for i in ids}
        self._reg_fn = traced(self.regularization_and_grads)
        self._has_regularizers = bool(
            topology.pipeline_comm.allreduce(len(self.regularized) > 0, op=mpi_op("LOR"))
        )
        self._squares_fn = traced(_sum_of_squares, reduce_retracing=True)
        self._shard_clipping = ShardClipping(self.variables, self.split_groups, guard)
        self._reg_values_fn = traced(self._reg_values)
        self._groups_for: tuple = (None, False)  # (id of the optimizer, whether grouped)
        self._position_groups: dict = {}  # positions -> their update groups (`apply_some`)
        self._compiled: dict = {}

    def loss_scale(self) -> float:
        return loss_scale(self.model.optimizer)

    def apply(self, gradients) -> float:
        """Step the optimizer with the reduced `gradients` (`gradient_sync.Gradients`); return
        the model's total regularization (collective over the pipeline)."""
        if self._grouped():
            return self._apply_grouped(gradients)
        across_ranks = self.clipping().global_norm_over == RANKS
        if gradients.layout is None or across_ranks or self.split_ids:
            return self._apply(gradients.as_list())
        return self._apply_flat(gradients.flat, gradients.tables)

    def local_regularization(self) -> float:
        """This stage's weight regularization (its shards' parts summed over their groups)."""
        return self.total_regularization(*self._reg_values_fn()) if self.regularized else 0.0

    def apply_some(self, grads: list, positions: list[int], step: int, norm=None) -> None:
        """The update of the variables at `positions` (`grads` in that order) in update groups,
        each group's gradients let go once applied, each group seeing optimizer step `step`:
        the counter is set to it before every group, and the last group of a step leaves it one
        further, as one `apply` of all would. With `norm`, clipped by that global norm."""
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.variables)
        key = tuple(positions)
        if key not in self._position_groups:
            groups = update_groups([self.variables[i] for i in positions])
            self._position_groups[key] = [[positions[j] for j in g] for g in groups]
        where = dict(zip(positions, range(len(positions)), strict=True))
        scale = tf.constant(self.loss_scale(), tf.float32)
        for members in self._position_groups[key]:
            taken = [grads[where[i]] for i in members]
            for i in members:
                grads[where[i]] = None
            optimizer.iterations.assign(step)
            update = self.compiled_update(self._group_body, key=tuple(members), group=members)
            update(taken, scale) if norm is None else update(taken, scale, norm)
            taken = None

    def regularization(self) -> float:
        """The model's total weight regularization (collective over the pipeline)."""
        return self.sum_over_pipeline(
            self.total_regularization(*self._reg_fn()[:2]) if self.regularized else 0.0
        )

    def check_finite(self, losses, grads, step: int) -> None:
        """Stop every rank together, naming step, rank and stage, on a NaN/Inf loss or gradient."""
        problem = None
        if any(not np.isfinite(float(loss)) for loss, _ in losses):
            problem = "loss"
        elif any(not _finite(g) for g in grads):
            bad = next(v for v, g in zip(self.variables, grads, strict=True) if not _finite(g))
            problem = f"gradient of {bad.path}"
        topo = self.topology
        with self.guard("agree on numerics"):
            reports = topo.world.allgather(
                None if problem is None else (topo.rank, topo.stage, problem)
            )
        found = [r for r in reports if r is not None]
        if found:
            rank, stage, what = found[0]
            raise AgreedError(
                FloatingPointError(
                    f"Non-finite {what} at step {step} on rank {rank} (pipeline stage "
                    f"{stage}); check the inputs for NaN/Inf, lower the learning rate, or use "
                    "gradient clipping."
                )
            )

    def regularization_and_grads(self):
        """(regularization of whole variables, of each group's shards (`split_groups`), the
        gradients of both)."""
        with tf.GradientTape() as tape:
            whole, parts = self._reg_values()
            total = whole + tf.reduce_sum(parts)
        return whole, parts, tape.gradient(total, self.regularized)

    def total_regularization(self, whole, parts) -> float:
        """This stage's regularization: the whole variables' plus each group's shards' parts,
        summed over the group (tensor ranks, expert group)."""
        total = float(whole)
        for (_, comm), part in zip(self.split_groups, np.asarray(parts), strict=True):
            with self.guard("sum regularization over the ranks holding shards"):
                total += comm.allreduce(float(part))
        return total

    def agree_finite_for_loss_scaling(self, grads: list) -> list:
        """Under loss scaling, every stage must skip an overflowing step together: if any rank
        saw Inf/NaN, all hand NaN gradients to their LossScaleOptimizer, which then skips the
        step and lowers the scale identically everywhere."""
        finite = all(_finite(g) for g in grads)
        with self.guard("agree on finite scaled gradients"):
            finite = self.topology.world.allreduce(finite, op=mpi_op("LAND"))
        if finite:
            return grads
        return [
            row_sparse.like(g, tf.fill(tf.shape(row_sparse.values_of(g)), _nan(g.dtype)))
            for g in grads
        ]

    def _apply(self, grads: list) -> float:
        """Add regularization gradients, step the optimizer; return the total regularization."""
        reg_value = 0.0
        if self.regularized:
            whole, parts, reg_grads = self._reg_fn()
            reg_value = self.total_regularization(whole, parts)
            # the stage gradients are of the scaled loss
            grads = self._add_regularization(grads, reg_grads, self.loss_scale())
        reg_value = self.sum_over_pipeline(reg_value)
        if isinstance(self.model.optimizer, LossScaleOptimizer):
            grads = self.agree_finite_for_loss_scaling(grads)
        clipping = self.clipping()
        if clipping.shards_by_whole_variable:
            clip = inner_optimizer(self.model.optimizer).clipnorm
            grads = self._shard_clipping.clip(grads, clip, self.loss_scale())
        norm = self._pipeline_norm(grads) if clipping.global_norm_over == RANKS else None
        if self.variables:  # a stage of only Add/Activation layers has nothing to update
            self._optimizer_step(grads, norm)
        return reg_value

    def clipping(self) -> Clipping:
        """How the model's optimizer clips this stage's gradients (`clipping.py`): by a global
        norm over the ranks, and split variables (tensor or expert shards) by their whole
        variables' norms, which `_apply` clips first (`ShardClipping`)."""
        inner = inner_optimizer(self.model.optimizer)
        return decide_clipping(
            getattr(inner, "clipnorm", None), getattr(inner, "global_clipnorm", None),
            partitioned=self._partitioned, split_variables=bool(self.split_ids),
        )  # fmt: skip

    def _pipeline_norm(self, grads: list):
        """Keras's global gradient norm of the whole model (its `global_clipnorm`): squares of
        the variables each stage owns, summed over the pipeline (a shared layer counts once).
        Collective over the pipeline."""
        owned = {id(v) for v in self.owned}
        scale = tf.constant(self.loss_scale(), tf.float32)
        mine = [
            g for v, g in zip(self.variables, grads, strict=True) if id(v) in owned - self.split_ids
        ]
        squares = float(self._squares_fn(mine, scale)) if mine else 0.0
        for ids, comm in self.split_groups:  # shards' squares add up to their whole variables'
            parts = [g for v, g in zip(self.variables, grads, strict=True) if id(v) in owned & ids]
            parts = float(self._squares_fn(parts, scale)) if parts else 0.0
            with self.guard("sum the gradient norm over the ranks holding shards"):
                squares += comm.allreduce(parts)
        with self.guard("sum the gradient norm over the pipeline"):
            total = self.topology.pipeline_comm.allreduce(squares)
        return tf.constant(math.sqrt(total), tf.float32)

    def _add_regularization(self, grads: list, reg_grads: list, scale) -> list:
        """`grads` with the owned variables' regularization gradients (times the loss scale)."""
        grads = list(grads)
        position = {id(v): i for i, v in enumerate(self.variables)}
        for v, g in zip(self.regularized, reg_grads, strict=True):
            i = position[id(v)]
            # dense, as one process's tape sums a table's row slices and a dense gradient
            grads[i] = tf.convert_to_tensor(grads[i]) + tf.cast(g, grads[i].dtype) * scale
        return grads

    def _apply_flat(self, flat, tables: list) -> float:
        """`_apply` for reduced flat gradients, the update one compiled call: split into views,
        add regularization, step the optimizer. Pipeline stages agree on a loss-scale overflow
        first (an unpartitioned model's replicas hold the same sums: they see it alike)."""
        if self._partitioned and isinstance(self.model.optimizer, LossScaleOptimizer):
            (flat, *tables) = self.agree_finite_for_loss_scaling([flat, *tables])
        update = self.compiled_update(self._flat_apply_body)
        value = update(flat, tables, tf.constant(self.loss_scale(), tf.float32))
        return self.sum_over_pipeline(float(value) if self.regularized else 0.0)

    def sum_over_pipeline(self, reg_value: float) -> float:
        """This stage's regularization summed over its pipeline (collective when any stage has
        regularizers; as is, if none has)."""
        if not self._has_regularizers:
            return reg_value
        with self.guard("sum regularization over the pipeline"):
            return self.topology.pipeline_comm.allreduce(reg_value)

    def _flat_apply_body(self, flat, tables, scale):
        grads = self._merge(self._layout.unflatten(flat), tables)
        value = tf.constant(0.0)
        if self.regularized:  # never tensor shards: their update takes `_apply`
            whole, parts, reg_grads = self.regularization_and_grads()
            value = whole + tf.reduce_sum(parts)
            grads = self._add_regularization(grads, reg_grads, scale)
        self.model.optimizer.apply(grads, self.variables)
        return value

    def _optimizer_step(self, grads: list, norm=None) -> None:
        """The optimizer's update as one compiled call, as Keras's own train step runs it (run
        eagerly, Keras's optimizers dispatch a few dozen ops per variable); with `norm`,
        clipped by that global norm instead of the stage's own."""
        if norm is None:
            self.compiled_update(self._optimizer_body)(list(grads))
        else:
            self.compiled_update(self._clipped_optimizer_body)(list(grads), norm)

    def _optimizer_body(self, grads):
        self.model.optimizer.apply(grads, self.variables)

    def _clipped_optimizer_body(self, grads, norm):
        """Keras's `clip_by_global_norm` with the whole model's norm, then the update."""
        apply_clipped(self.model.optimizer, grads, self.variables, norm)

    # --- the update in groups of variables ------------------------------------------------------
    def _grouped(self) -> bool:
        """Whether this step's update runs group by group (`update_groups`): more than one
        group, an optimizer that applies per variable, and no clipping by a global norm that
        would have to include regularization gradients first."""
        optimizer = self.model.optimizer
        key = id(optimizer)
        if self._groups_for[0] != key:
            clipping = self.clipping()
            groups = update_groups(self.variables)
            usable = len(groups) > 1 and applies_per_variable(optimizer)
            usable = usable and not clipping.shards_by_whole_variable  # `_apply` clips them
            self._groups_for = (key, usable and not (clipping.by_global_norm and self.regularized))
        return self._groups_for[1]

    def _apply_grouped(self, gradients) -> float:
        """The optimizer's update group by group, each group's gradients let go once applied
        (the step counter is put back between groups, so every group sees the same step)."""
        grads = list(gradients.as_list())
        gradients.grads = gradients.flat = None  # this list is the last reference
        gradients.tables = []
        reg_value = self.sum_over_pipeline(self.local_regularization())
        norm = None
        over = self.clipping().global_norm_over  # without regularization (`_grouped`)
        if over is not None:
            norm = self._pipeline_norm(grads) if over == RANKS else self._norm(grads)
        if self.variables:
            step = int(self.model.optimizer.iterations.numpy())
            self.apply_some(grads, list(range(len(self.variables))), step, norm)
        return reg_value

    def _norm(self, grads):
        """Keras's global gradient norm of `grads` (this stage's, all of the model's)."""
        scale = tf.constant(self.loss_scale(), tf.float32)
        return tf.sqrt(self._squares_fn(grads, scale))

    def _reg_values(self):
        """(regularization of whole variables, a vector of each group's shards' parts
        (`split_groups`)), without gradients."""
        values = [tf.reduce_sum(v.regularizer(v)) for v in self.regularized]

        def total(keep):
            kept = [x for v, x in zip(self.regularized, values, strict=True) if keep(id(v))]
            return tf.add_n(kept) if kept else tf.constant(0.0)

        parts = [total(lambda i, ids=ids: i in ids) for ids, _ in self.split_groups]
        whole = total(lambda i: i not in self.split_ids)
        return whole, (tf.stack(parts) if parts else tf.zeros([0]))

    def _group_body(self, grads, scale, norm=None, *, group):
        """One group's update: its regularization gradients added (times the loss scale),
        clipped by the whole model's `norm` if given, then `optimizer.apply`."""
        variables = [self.variables[i] for i in group]
        regularized = [v for v in variables if getattr(v, "regularizer", None)]
        grads = list(grads)
        if regularized:
            with tf.GradientTape() as tape:
                total = tf.add_n([tf.reduce_sum(v.regularizer(v)) for v in regularized])
            by_variable = dict(
                zip(map(id, regularized), tape.gradient(total, regularized), strict=True)
            )
            for j, v in enumerate(variables):
                if id(v) in by_variable:
                    grads[j] = tf.convert_to_tensor(grads[j]) + tf.cast(
                        by_variable[id(v)], grads[j].dtype
                    ) * tf.cast(scale, grads[j].dtype)
        if norm is None:
            self.model.optimizer.apply(grads, variables)
        else:
            apply_clipped(self.model.optimizer, grads, variables, norm)

    def compiled_update(self, body, key=None, **bound):
        """`body` as a `tf.function`, traced anew for each optimizer object (a recompiled model
        gets a new one), the optimizer built first: variables cannot be created in a trace."""
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.variables)
        name = (body.__name__, key)
        if name not in self._compiled or self._compiled[name][0] is not optimizer:
            function = functools.partial(body, **bound) if bound else body
            # Tables' row counts vary by step: traced with them unknown; any other shape that
            # varies generalises after a retrace, as Keras does.
            self._compiled[name] = (
                optimizer, rows_unknown(traced(function, reduce_retracing=True))
            )  # fmt: skip
        return self._compiled[name][1]


def inner_optimizer(optimizer):
    """The optimizer that clips: a LossScaleOptimizer's inner one."""
    return optimizer.inner_optimizer if isinstance(optimizer, LossScaleOptimizer) else optimizer


def _sum_of_squares(grads, scale):
    """Keras's squared global norm of `grads` (row slices count each pair), unscaled."""
    return ops.sum(ops.stack([ops.sum(ops.square(g)) for g in grads])) / ops.square(scale)


def _finite(grad) -> bool:
    return bool(tf.reduce_all(tf.math.is_finite(row_sparse.values_of(grad))))


def _nan(dtype):
    return tf.constant(float("nan"), dtype)
