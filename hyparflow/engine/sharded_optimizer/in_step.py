"""ZeRO-1, 2 and 3 under a model's own step: an optimizer's `apply`, compiled inside that
step, updates this replica's slice.

A step of the model's own (engine/custom_step.py: an overridden `train_step`, or Keras's step
around an overridden `compute_loss`) makes whole gradients with its own tape and hands them to
an optimizer's `apply`. While the step is traced, that `apply` is replaced by a `SlicedApply`
(each optimizer its own: step_optimizers.py): the gradients, each replica's weighted by its
share of the global batch, are flattened into the slice groups of the variables it applies
(the stage's `ShardedUpdate.groups` for the compiled optimizer on every variable, else its
`OptimizerSlices`; one flat vector per dtype) and reduce-scattered; under loss scaling the
replicas agree on whether any slice overflowed; `global_clipnorm` clips by the norm of the
variables applied (squares summed over the replicas); the optimizer steps this replica's
slice variables, for which alone it built its state; the new slices are all-gathered into the
variables, which stay the truth between steps. Checkpoints and the fit's end read the slices
through a `SliceCheckpoint`, as under the engine's own step.

The step's own gradients are whole, since its tape makes them: `shard_gradients` shards only
their reduced sums. Under `shard_weights` (ZeRO-3) the variables hold nothing between steps
(`ShardedWeights.release`): the step begins by all-gathering the slices into them (`fill`), so
that its tape differentiates them as Keras's step does, and ends by emptying them (`empty`);
the variables' backings stay the same resources (`deferred.take_over`), so the step is traced
once. A step so holds the whole weights and gradients for a moment, as ZeRO-3 on a stage that
is not cut does, and only its slices between steps.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf
from keras.optimizers import LossScaleOptimizer

from hyparflow import deferred
from hyparflow.comm.agree import AgreedError
from hyparflow.comm.in_graph import allgather, allreduce, collective
from hyparflow.engine.gradients.update import apply_clipped, inner_optimizer
from hyparflow.engine.sharded_optimizer.sharded_update import windowed_reduce_scatter

if TYPE_CHECKING:
    from hyparflow.engine.sharded_optimizer.optimizer_slices import SliceSet


class SlicedApply:
    """The replacement of an optimizer's `apply` in a model's own step, over `slices`' slices
    (the trainer's `ShardedUpdate` of the whole model for its compiled optimizer, or an
    `OptimizerSlices`: either has `optimizer`, `variables`, `groups` and `load_slices`); its
    collectives run over `comm` (the replicas), count in `traffic`, and are watched by
    `guard(operation)`. `slices_only` (ZeRO-3, the whole model's slices): the slices are the
    weights between steps, and the variables hold values only inside the step (`fill`,
    `empty`).

    Example:
        sliced = SlicedApply(sharded, comm, traffic, guard)
        with Replaced([(optimizer, "apply", lambda apply: sliced.replacing(apply, weight))]):
            model.train_step(data)  # traced: its optimizer.apply steps this replica's slice
    """

    def __init__(self, slices: SliceSet, comm, traffic, guard, slices_only: bool = False):
        self.sharded = slices
        self.optimizer = slices.optimizer
        self.variables = list(slices.variables)
        self.comm, self.traffic, self.guard = comm, traffic, guard
        self.slices_only = slices_only

    def fill(self) -> None:
        """Inside a trace: the variables take the slices' current values, all-gathered from
        the replicas (ZeRO-3's step begins with it; every sharded step ends its update so)."""
        for group in self.sharded.groups:
            self._gather(group)

    def empty(self) -> None:
        """Inside a trace (ZeRO-3): the sliced variables let their values go again."""
        groups = self.sharded.groups
        deferred.let_go([self.variables[i] for group in groups for i in group.positions])

    def replacing(self, apply, weight):
        """What stands for `apply` (the optimizer's method) while a step is traced, this
        replica's gradients weighted by `weight` (a tensor: its share of the global batch)."""
        return functools.partial(self._apply, apply, weight)

    def _apply(self, apply, weight, grads, trainable_variables=None):
        grads = self._in_stage_order(list(grads), trainable_variables)
        groups = self.sharded.groups
        slices = [self._reduced(group, grads, weight) for group in groups]
        if isinstance(self.optimizer, LossScaleOptimizer):
            slices = self._agreed_overflow(slices)
        if not self.slices_only:
            self.sharded.load_slices()  # the variables are the truth between steps
        targets = [group.variable for group in groups]
        if inner_optimizer(self.optimizer).global_clipnorm:
            apply_clipped(self.optimizer, slices, targets, self._global_norm(slices), apply)
        else:
            apply(slices, targets)
        self.fill()  # the step may read its weights after its update, as in Keras's

    def _in_stage_order(self, grads: list, variables) -> list:
        """`grads` of `variables` (None: all of the slices' variables) in the slices' order; a
        variable given no gradient is an error (raised alike on every replica, while
        tracing)."""
        variables = self.variables if variables is None else list(variables)
        given = {id(v): g for v, g in zip(variables, grads, strict=True)}
        missing = [v.path for v in self.variables if given.get(id(v)) is None]
        if missing:
            raise AgreedError(  # every replica traces the same step: raised alike everywhere
                ValueError(
                    f"The model's own step applies {type(self.optimizer).__name__} "
                    f"({self.optimizer.name}) with no gradient for some of its variables "
                    f"(missing: {missing[:3]}); sharding its state (shard_optimizer, "
                    "shard_gradients, shard_weights) reduce-scatters a gradient for each one. "
                    "Apply it only to variables with gradients, or leave the optimizer state "
                    "unsharded."
                )
            )
        return [tf.convert_to_tensor(given[id(v)]) for v in self.variables]

    def _reduced(self, group, grads: list, weight):
        """This replica's slice of `group`'s gradients, weighted and summed over the replicas,
        in the group's dtype: reduce-scattered in the engine's windows straight from the
        gradients (no flat copy of them: `windowed_reduce_scatter`)."""
        wire = group.reduced_dtype
        guard = self.guard
        parts = [tf.cast(grads[i], wire) for i in group.positions]

        def scatter(*arrays):
            views = [np.reshape(a, -1) for a in arrays[:-1]]
            return windowed_reduce_scatter(self.comm, group, views, float(arrays[-1]), guard)

        inputs = [*parts, tf.cast(weight, wire)]
        nbytes = group.reduce_scatter_bytes
        shape = [group.layout.slice_size]
        sliced = collective(scatter, inputs, tf.as_dtype(wire), shape, self.traffic, nbytes)
        return tf.cast(sliced, group.dtype)

    def _agreed_overflow(self, slices: list) -> list:
        """`slices`, all NaN on every replica where any replica's holds a non-finite value:
        the loss-scale optimizer then skips the step and lowers its scale everywhere, as one
        process does when any gradient overflows."""
        counts = [tf.reduce_sum(tf.cast(~tf.math.is_finite(s), tf.float32)) for s in slices]
        overflowed = allreduce(self.comm, tf.reshape(tf.add_n(counts), [1]), self.traffic)[0] > 0
        return [tf.where(overflowed, tf.fill(tf.shape(s), _nan(s.dtype)), s) for s in slices]

    def _global_norm(self, slices: list):
        """The whole model's gradient norm, unscaled (Keras's clipping reads the gradients the
        loss-scale optimizer has divided by its scale): the slices' squares summed over the
        replicas (their padding is zeros)."""
        squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(s, tf.float32))) for s in slices])
        total = allreduce(self.comm, tf.reshape(squares, [1]), self.traffic)[0]
        scale = 1.0
        if isinstance(self.optimizer, LossScaleOptimizer):
            scale = tf.cast(self.optimizer.scale_loss(tf.constant(1.0)), tf.float32)
        return tf.sqrt(total) / scale

    def _gather(self, group) -> None:
        """Every replica's updated slice of `group`, all-gathered, assigned to its variables."""
        whole = allgather(self.comm, group.variable.value, 0, self.traffic)
        layout = group.layout
        for j, i in enumerate(group.positions):
            variable = self.variables[i]
            start = layout.offsets[j]
            part = whole[start : start + layout.sizes[j]]
            variable.assign(tf.reshape(part, variable.shape))


def _nan(dtype):
    return tf.constant(float("nan"), dtype)
