"""Keras metric states summed across replicas, turned into logs every rank agrees on."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hyparflow import _keras
from hyparflow.traced import traced


class ReplicaMetrics:
    """`model.get_metrics_result()` as if all replicas on `comm` had fed one metric set.

    Keras metric states (totals, counts, confusion counts) add up across disjoint data, so the
    states are summed over `comm`, read out, and the local states put back untouched. The
    training loop may ask for these logs after every step, so swapping the sums in, computing
    the results and restoring are one compiled call after the `Allreduce`, not eager work per
    variable (docs/engine.md, "Logs").

    For example:
        logs = ReplicaMetrics(model, topology.stage_comm)()  # {"loss": 0.31, ...}
    """

    def __init__(self, model, comm) -> None:
        self.model, self.comm = model, comm
        self._results = traced(model.get_metrics_result)
        self._built_for: tuple = ()

    def __call__(self) -> dict:
        if self.comm.Get_size() == 1 or not self.model.metrics_variables:
            return to_floats(self._results())
        local = self.local_states()
        summed = np.empty_like(local)
        self.comm.Allreduce(local, summed)
        return self.results_with(summed)

    def local_states(self) -> np.ndarray:
        """This replica's metric states, flattened into one float64 vector."""
        self._build()
        return self._pack()

    def results_with(self, summed: np.ndarray) -> dict:
        """The results of the states `summed` (as `local_states` lays them out) as floats;
        the local states are left as they were."""
        self._build()
        return to_floats(self._results_of(tf.constant(summed)))

    def _build(self) -> None:
        variables = list(self.model.metrics_variables)
        if self._built_for == tuple(id(v) for v in variables):
            return  # (metrics build lazily: rebuilt when their variables change)
        sizes = [int(np.prod(v.shape)) for v in variables]

        def pack():
            return tf.concat([tf.reshape(tf.cast(v.value, tf.float64), [-1]) for v in variables], 0)

        def read():  # a compiled call costs as much as reading ~6 variables one by one
            return np.concatenate([np.asarray(v.numpy(), np.float64).ravel() for v in variables])

        def results_of(summed):
            # automatic control dependencies keep program order on each variable:
            # read the local states, write the sums, read the results, write the states back
            local = [tf.identity(v.value) for v in variables]
            for variable, part in zip(variables, tf.split(summed, sizes), strict=True):
                variable.assign(tf.cast(tf.reshape(part, variable.shape), variable.dtype))
            results = self.model.get_metrics_result()
            for variable, value in zip(variables, local, strict=True):
                variable.assign(value)
            return results

        compiled = traced(pack)
        self._pack = read if len(variables) <= 6 else lambda: compiled().numpy()
        self._results_of = traced(results_of)
        self._built_for = tuple(id(v) for v in variables)


def to_floats(logs: dict) -> dict:
    """Scalar tensors to Python floats, so logs pickle cheaply and compare exactly."""
    return {k: float(np.asarray(v)) if np.ndim(v) == 0 else np.asarray(v) for k, v in logs.items()}


def build_outside_the_trace(metrics, y, y_pred) -> None:
    """Build Keras's compiled `metrics` for `y` and `y_pred` from inside a traced step, with
    their variables made eagerly and not recorded as the trace's own.

    Keras builds them lazily, at the first update. A `tf.function` whose first call creates
    variables is traced a second time before it runs again (TensorFlow's rule for functions
    that create state), so the compiled step would be traced once more; Keras's own `fit`
    avoids that by building them before its first step.
    """

    def unrecorded(next_creator, **options):
        return next_creator(**{**options, "experimental_enable_variable_lifting": False})

    with tf.init_scope(), tf.variable_creator_scope(unrecorded):
        metrics.build(y, y_pred)


def compiled_metrics_update(model):
    """`update(y, y_pred, sample_weight)` of `model`'s compiled metrics, as Keras's train step
    runs it (nothing without compiled metrics); built outside the trace on first use."""

    def update(y, y_pred, sample_weight):
        metrics = _keras.compiled_metrics(model)
        if metrics is None:
            return
        if not metrics.built:
            build_outside_the_trace(metrics, y, y_pred)
        metrics.update_state(y, y_pred, sample_weight)

    return update
