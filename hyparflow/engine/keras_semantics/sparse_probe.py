"""Which variables receive row-sparse gradients, and whether their rows come per sample or batch.

A gather's gradient is `tf.IndexedSlices`: one (row index, row value) pair per index looked up.
Looked up with the batch's own indices (token ids), a batch of b samples has b times a
sample's rows, and the rows of pieces of the batch (micro-batches, replicas) concatenate into
the batch's. Looked up with indices the whole batch shares (ViT's position ids of shape
(1, positions), broadcast over the batch; T5's and Swin's relative position tables), the batch
has the same rows as one sample, each value summed over the batch, and pieces add theirs row by
row. Keras's optimizers square each pair (Adam's second moment), so the two must not be
confused: concatenated, a broadcast table's pieces would be squared apart.

The kind is read from the model itself: its gradient is traced (never run) at the data's shapes
for batches of one and two samples, and each row-sparse gradient's static row count n(b) tells
it: n(2) = 2 n(1) per sample, n(2) = n(1) per batch. A variable whose rows are both (one table
looked up both ways) is refused up front. Under `hf.scope()` a rank classifies the variables
it holds, the only ones whose gradients it combines.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import tree

from hyparflow import deferred
from hyparflow.engine.gradients.sparse import RowKinds
from hyparflow.traced import traced

# Unknown lengths (a declared None other than the batch) take this size where no data gives one.
PROBE_LENGTH = 8


def probe_row_kinds(model, inputs=None) -> RowKinds:
    """The `RowKinds` of `model`'s trainable variables, traced at the shapes of `inputs` (a
    structure of arrays as the model takes them; None: its declared inputs). Unclassified
    (`complete=False`) when the gradient cannot be traced so; ValueError for a variable whose
    rows are both per sample and per batch."""
    specs = _specs(model, inputs)
    if specs is None:
        return RowKinds()
    try:
        one = _row_counts(model, _with_batch(specs, 1))
        two = _row_counts(model, _with_batch(specs, 2)) if one else {}  # no rows: no kinds
    except Exception:  # noqa: BLE001 - a model that cannot be traced so is refused later
        return RowKinds()
    return _classified(model, one, two)


def _classified(model, one: dict, two: dict) -> RowKinds:
    per_sample, per_batch, complete = set(), set(), True
    for v in model.trainable_variables:
        if id(v) not in one:
            continue
        n1, n2 = one[id(v)], two.get(id(v))
        if n1 is None or n2 is None:
            complete = False
        elif n2 == n1:
            per_batch.add(id(v))
        elif n2 == 2 * n1:
            per_sample.add(id(v))
        else:
            raise ValueError(mixed_message(v.path, n1, n2))
    return RowKinds(frozenset(per_sample), frozenset(per_batch), complete)


def mixed_message(path: str, rows_of_one: int, rows_of_two: int) -> str:
    return (
        f"Variable {path!r} receives row-sparse gradients looked up both with the batch's own "
        f"indices and with indices the whole batch shares ({rows_of_one} rows for one sample, "
        f"{rows_of_two} for two), which hyparflow cannot split over pieces of the batch as one "
        "process computes them; look it up one way, or train on one process."
    )


def _row_counts(model, specs) -> dict:
    """Static row count of each row-sparse gradient (None where unknown), by variable id, of
    the variables this process holds (under hf.scope(), the others read as placeholders)."""
    variables = [v for v in model.trainable_variables if not deferred.is_deferred(v)]
    sources = [getattr(v, "value", v) for v in variables]
    found: dict = {}

    def gradient(inputs):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(sources)
            outputs = model(inputs, training=True)
            floats = [o for o in tree.flatten(outputs) if o.dtype.is_floating]
            total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in floats])
        grads = tape.gradient(total, sources, unconnected_gradients=tf.UnconnectedGradients.NONE)
        for v, g in zip(variables, grads, strict=True):
            if isinstance(g, tf.IndexedSlices):
                found[id(v)] = g.values.shape[0]
        return tf.zeros(())

    traced(gradient).get_concrete_function(specs)
    return found


def _specs(model, inputs):
    """Specs of one batch's inputs with the batch unknown: from `inputs`' arrays, else the
    model's declared inputs (unknown lengths `PROBE_LENGTH`); None without either."""
    if inputs is None:
        try:
            inputs = model.input
        except (AttributeError, ValueError):  # subclassed, or never called
            return None
    return tree.map_structure(_spec, inputs)


def _spec(value) -> tf.TensorSpec:
    """`value`'s spec (an array's, or a declared input's) with the batch unknown."""
    shape = tuple(PROBE_LENGTH if d is None else d for d in tuple(value.shape)[1:])
    dtype = tf.as_dtype(keras.backend.standardize_dtype(value.dtype))
    return tf.TensorSpec((None, *shape), dtype)


def _with_batch(specs, batch: int):
    return tree.map_structure(lambda s: tf.TensorSpec((batch, *s.shape[1:]), s.dtype), specs)
