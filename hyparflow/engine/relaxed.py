"""A step's first trace already leaves unknown what varies: the batch and declared lengths.

Keras's train function is a `tf.function(reduce_retracing=True)`: its first call traces the
batch's exact shape, and a second call with another shape (the last, smaller batch; another
sequence length) traces again with the dimensions that differ unknown, and never again. The
engine calls its functions on micro-batches of several sizes (a replica's shard cut in
micro-batches, the last batch, validation, `evaluate` and `predict` at their own batch sizes),
so traced by shape it would trace each function three or four times. A model declares which
dimensions of its inputs vary (None in `model.input`, or in what a pipeline stage receives), so
a runner traces once, before its first call, with the batch size and exactly those dimensions
unknown: one trace where Keras makes two, and for a large model long traces fewer in the first
epoch. Every model Keras trains with a smaller last batch already runs Keras's second, relaxed
trace. Per-output loss means do not depend on the static batch size: the engine weights them
itself (`output_losses.py`). Targets and sample weights have no declared shape: every
dimension is left unknown, as a `tf.data` input of unknown shapes gives Keras's fit.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from keras import tree


def declared_shapes(model, stage) -> list[tuple] | None:
    """The declared shape, batch dimension first, of each flattened input of `stage` (or of the
    whole `model`, in `tree.flatten` order of its inputs), or None for a model that declares no
    inputs (subclassed: its functions trace as the data comes). A stage's batch is unknown; a
    model's is too unless it fixes one (`keras.Input(batch_shape=...)`)."""
    if stage is not None:
        return [(None, *t.shape) for t in stage.receives]  # receives: batch dimension left out
    shapes = [tuple(t.shape) for t in tree.flatten(_model_input(model))]
    return shapes or None


def _model_input(model):
    """`model.input` (the structure a call takes), or nothing for a model without one."""
    try:
        return model.input
    except (AttributeError, ValueError):  # a Sequential never called; subclassed
        return getattr(model, "inputs", None) or []


def trace_first(function, args: tuple, declared: list[tuple], targets: tuple = ()) -> None:
    """Trace `function` (a `tf.function`) for `args` with the batch size and the varying
    dimensions unknown, unless it has been traced before. `args[0]` are the inputs (`declared`:
    their shapes, by `declared_shapes`); `targets` are the positions of targets and sample
    weights."""
    if function.experimental_get_tracing_count() > 0:
        return
    function.get_concrete_function(*relaxed_specs(args, declared, targets))


def relaxed_specs(args: tuple, declared: list[tuple], targets: tuple = ()) -> list:
    """`args` with the inputs (`args[0]`, `declared`: their shapes) and `targets` as specs that
    leave unknown what varies (`trace_first`)."""
    specs = list(args)
    specs[0] = _input_specs(args[0], declared)
    for position in targets:
        specs[position] = tree.map_structure(_target_spec, args[position])
    return specs


def _input_specs(inputs, declared: list[tuple]):
    leaves = tree.flatten(inputs)
    if len(leaves) != len(declared):  # not the declared structure: trace as the data comes
        return inputs
    specs = [_spec(leaf, shape) for leaf, shape in zip(leaves, declared, strict=True)]
    return tree.pack_sequence_as(inputs, specs)


def _spec(value, declared: tuple) -> tf.TensorSpec:
    """`value`'s spec with the dimensions `declared` None unknown."""
    shape = tuple(value.shape)
    if len(shape) != len(declared):
        return tf.TensorSpec(shape, _dtype(value))
    dims = [None if want is None else have for want, have in zip(declared, shape, strict=True)]
    return tf.TensorSpec(dims, _dtype(value))


def _target_spec(value):
    if value is None:
        return None
    return tf.TensorSpec((None,) * len(np.shape(value)), _dtype(value))


def _dtype(value) -> tf.DType:
    return tf.as_dtype(value.dtype)


def rows_unknown(function):
    """`function` (a `tf.function`) whose first call traces with the row count of every row
    slice (`tf.IndexedSlices`: an embedding table's gradient) unknown. Each step gathers other
    rows, so traced by shape the optimizer's update would trace twice, as Keras's own train
    function does; the update's graph does not depend on the count."""

    def call(*args):
        if function.experimental_get_tracing_count() == 0 and _has_rows(args):
            function.get_concrete_function(*tf.nest.map_structure(_rows_spec, args))
        return function(*args)

    return call


def _has_rows(args) -> bool:
    return any(isinstance(leaf, tf.IndexedSlices) for leaf in tf.nest.flatten(args))


def _rows_spec(value):
    if not isinstance(value, tf.IndexedSlices):
        return value
    return tf.IndexedSlicesSpec(
        shape=tf.get_static_value(value.dense_shape), dtype=value.values.dtype,
        indices_dtype=value.indices.dtype, dense_shape_dtype=value.dense_shape.dtype,
        indices_shape=[None],
    )  # fmt: skip
