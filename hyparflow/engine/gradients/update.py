"""A stage's optimizer update: one executor of an `UpdatePlan` (engine/gradients/update_plan.py)."""

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
from hyparflow.engine.gradients.update_plan import (
    APART,
    CALL,
    FIRST,
    UpdatePlan,
    plan_update,
    update_groups,
)
from hyparflow.engine.relaxed import rows_unknown
from hyparflow.traced import traced


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


def apply_clipped(optimizer, grads, variables, norm, apply=None) -> None:
    """`optimizer.apply` (or `apply`, that method as it was before a replacement) after Keras's
    `clip_by_global_norm` by `norm`, the whole model's gradient norm (a stage, a group or a
    slice alone would clip by its own). NaN if `norm` is not finite, as Keras's."""
    inner = inner_optimizer(optimizer)
    clip = inner.global_clipnorm
    scale = clip * ops.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
    inner.global_clipnorm = None
    try:
        # a table's row slices times the scale become dense, as in Keras's own clipping
        (apply or optimizer.apply)([g * tf.cast(scale, g.dtype) for g in grads], variables)
    finally:
        inner.global_clipnorm = clip


def apply_step(optimizer, grads, variables, norm=None) -> None:
    """`optimizer.apply`, clipped by the whole model's `norm` where one is given."""
    if norm is None:
        optimizer.apply(grads, variables)
    else:
        apply_clipped(optimizer, grads, variables, norm)


def regularization_in_call(variables) -> tuple:
    """(the summed regularization of those of `variables` with a regularizer, id -> its
    gradient), inside a compiled update call; (None, {}) if none has one."""
    regularized = [v for v in variables if getattr(v, "regularizer", None)]
    if not regularized:
        return None, {}
    with tf.GradientTape() as tape:
        total = tf.add_n([tf.reduce_sum(v.regularizer(v)) for v in regularized])
    return total, dict(zip(map(id, regularized), tape.gradient(total, regularized), strict=True))


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
    has `global_clipnorm` and the model is `partitioned`, and runs the optimizer in compiled
    calls, all as its `UpdatePlan` says (`plan`, from the pure `plan_update`). `guard(operation)`
    watches each blocking collective; `merge(dense, tables)` puts dense gradients and tables'
    row slices back in variable order; `layout` is the `FlatLayout` of flat gradients (None if
    they are a list). `split`: the tensor shards; `expert_split`: (expert shards, their expert
    group's communicator).

    `run(plan, grads, target)` is the one way an update runs: the whole stage's (`apply`), a
    segment's (`SegmentUpdate`) and ZeRO-1's slices' (`ShardedUpdate`, its own `target`).
    A target offers `build_optimizer()`, `regularize(grads, scale)`, `global_norm(grads, over,
    scale)`, `update_body(grads, scale, norm=None, *, group, flat, regularize)` (compiled once
    per group) and `after_update(group, output)`; this object is the stage's own.
    """

    def __init__(
        self,
        model,
        topology,
        variables,
        owned,
        *,
        partitioned: bool,
        guard,
        merge,
        layout=None,
        split=(),
        expert_split=((), None),
    ):
        self.model, self.topology, self.variables, self.owned = model, topology, variables, owned
        self._partitioned, self.guard, self._merge, self._layout = partitioned, guard, merge, layout
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
        self._plan_for: tuple = (None, None)  # (the optimizer, its plan)
        self._compiled: dict = {}

    def loss_scale(self) -> float:
        return loss_scale(self.model.optimizer)

    def plan(self) -> UpdatePlan:
        """How this stage's update runs after its gradients are reduced, for the model's
        optimizer (`update_plan.plan_update`)."""
        optimizer = self.model.optimizer
        if self._plan_for[0] is not optimizer:
            plan = plan_update(
                update_groups(self.variables),
                clipping=self.clipping(),
                applies_per_variable=applies_per_variable(optimizer),
                regularized=bool(self.regularized),
                loss_scaling=isinstance(optimizer, LossScaleOptimizer),
                flat=self._layout is not None,
                partitioned=self._partitioned,
                split_variables=bool(self.split_ids),
            )
            self._plan_for = (optimizer, plan)
        return self._plan_for[1]

    def apply(self, grads: list) -> float:
        """Step the optimizer with the step's reduced gradients, handed over
        (`Gradients.give_up`: `[flat, *tables]` where they are flat, else in variable order);
        return the model's total regularization (collective over the pipeline)."""
        plan = self.plan()
        if self._layout is not None and not plan.flat:
            grads = self._listed(*grads)
        return self.run(plan, grads)

    def run(self, plan: UpdatePlan, grads: list, target=None, step: int | None = None) -> float:
        """Run `plan` on `grads`, handed over (each group's are let go once it is applied), for
        `target` (default: this stage's variables): regularization, the loss-scale agreement,
        the clipping, then one compiled call per group, each at optimizer step `step` where the
        plan puts the counter back (default: the optimizer's now). Returns the model's
        regularization, or 0.0 where the plan leaves it to the caller. Collective as the plan
        says."""
        target = self if target is None else target
        scale = self.loss_scale()
        value = 0.0
        if plan.regularize_first and self.regularized:
            grads, whole, parts = target.regularize(grads, scale)
            value = self.total_regularization(whole, parts)
        elif plan.value == APART:
            value = self.local_regularization()
        if plan.agree_finite:
            grads = self.agree_finite_for_loss_scaling(grads)
        if plan.value in (FIRST, APART):
            value = self.sum_over_pipeline(value)
        if plan.clip_shards:
            clipnorm = inner_optimizer(self.model.optimizer).clipnorm
            grads = self._shard_clipping.clip(grads, clipnorm, scale)
        norm = target.global_norm(grads, plan.norm_over, scale) if plan.norm_over else None
        output = self._apply_groups(plan, grads, target, step, norm)
        if plan.value == CALL:
            value = self.sum_over_pipeline(float(output) if self.regularized else 0.0)
        return value

    def _apply_groups(self, plan: UpdatePlan, grads: list, target, step, norm):
        """One compiled call per group of `plan`, each taking its gradients out of `grads`
        (all of them where they arrive flat); the last call's output."""
        if not plan.groups:  # a stage of only Add/Activation layers has nothing to update
            return None
        target.build_optimizer()
        iterations = self.model.optimizer.iterations
        if plan.reset_step and step is None:
            step = int(iterations.numpy())
        scale = tf.constant(self.loss_scale(), tf.float32)
        start, output = 0, None
        for group in plan.groups:
            count = len(grads) if plan.flat else len(group)
            taken = grads[start : start + count]
            grads[start : start + count] = [None] * count  # the group's only reference now
            start += count
            if plan.reset_step:
                iterations.assign(step)
            update = self.compiled_update(
                target.update_body,
                key=(group, plan.flat, plan.regularize_first),
                group=group,
                flat=plan.flat,
                regularize=not plan.regularize_first,
            )
            output = update(taken, scale) if norm is None else update(taken, scale, norm)
            target.after_update(group, output)
            taken = None
        return output

    # --- this stage's variables as the target of `run` -----------------------------------------
    def build_optimizer(self) -> None:
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.variables)

    def regularize(self, grads: list, scale: float) -> tuple:
        """(`grads` plus the owned variables' regularization gradients (times the loss scale:
        the stage gradients are of the scaled loss), its whole and split parts)."""
        whole, parts, reg_grads = self._reg_fn()
        return self._add_regularization(grads, reg_grads, scale), whole, parts

    def global_norm(self, grads: list, over: str, scale: float):
        """Keras's global gradient norm of the whole model: over the pipeline and the ranks
        holding shards (`RANKS`), else of this stage's `grads` (all of the model's)."""
        if over == RANKS:
            return self._pipeline_norm(grads)
        return tf.sqrt(self._squares_fn(grads, tf.constant(scale, tf.float32)))

    def update_body(self, grads, scale, norm=None, *, group, flat, regularize):
        """One group's update, compiled: `grads` split into views where they arrive flat, the
        group's regularization gradients added (times the loss scale) if `regularize`, clipped
        by the whole model's `norm` if given, then `optimizer.apply`. Returns the group's
        regularization (0 without)."""
        if flat:
            grads = self._merge(self._layout.unflatten(grads[0]), grads[1:])
        variables = [self.variables[i] for i in group]
        value = tf.constant(0.0)
        if regularize:
            total, by_variable = regularization_in_call(variables)
            if by_variable:
                value, grads = total, list(grads)
            for j, v in enumerate(variables):
                if id(v) in by_variable:
                    g = tf.convert_to_tensor(grads[j])
                    grads[j] = g + tf.cast(by_variable[id(v)], g.dtype) * tf.cast(scale, g.dtype)
        apply_step(self.model.optimizer, grads, variables, norm)
        return value

    def after_update(self, group, output) -> None:
        """Nothing: the stage's variables are updated in place."""

    # ----------------------------------------------------------------------------------------
    def local_regularization(self) -> float:
        """This stage's weight regularization (its shards' parts summed over their groups)."""
        return self.total_regularization(*self._reg_values_fn()) if self.regularized else 0.0

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

    def clipping(self) -> Clipping:
        """How the model's optimizer clips this stage's gradients (`clipping.py`): by a global
        norm over the ranks, and split variables (tensor or expert shards) by their whole
        variables' norms, which `run` clips first (`ShardClipping`)."""
        inner = inner_optimizer(self.model.optimizer)
        return decide_clipping(
            getattr(inner, "clipnorm", None),
            getattr(inner, "global_clipnorm", None),
            partitioned=self._partitioned,
            split_variables=bool(self.split_ids),
        )

    def sum_over_pipeline(self, reg_value: float) -> float:
        """This stage's regularization summed over its pipeline (collective when any stage has
        regularizers; as is, if none has)."""
        if not self._has_regularizers:
            return reg_value
        with self.guard("sum regularization over the pipeline"):
            return self.topology.pipeline_comm.allreduce(reg_value)

    def compiled_update(self, body, key=None, **bound):
        """`body` as a `tf.function`, traced anew for each optimizer object (a recompiled model
        gets a new one), the optimizer built first: variables cannot be created in a trace."""
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.variables)
        name = (body.__qualname__, key)
        if name not in self._compiled or self._compiled[name][0] is not optimizer:
            function = functools.partial(body, **bound) if bound else body
            # Tables' row counts vary by step: traced with them unknown; any other shape that
            # varies generalises after a retrace, as Keras does.
            function = rows_unknown(traced(function, reduce_retracing=True))
            self._compiled[name] = (optimizer, function)
        return self._compiled[name][1]

    def _listed(self, flat, *tables) -> list:
        """Flat gradients as one list in variable order (views of `flat`)."""
        return self._merge(self._layout.unflatten_fn(flat), list(tables))

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
