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

Some models cannot be traced with a length unknown: their call reads it as a Python int (a
keras_hub RWKV-7 loops `for t in range(T)`). Keras traces them first at the data's shapes and
trains them while only the batch size varies. Where a function's relaxed trace raises,
`Traces` traces it again, once per distinct length, with only the batch size unknown, and per
distinct shape where that raises too; a genuine error raises again at the data's shapes, as
Keras would report it. What fails depends on the model and the shapes alone, so every rank
falls back alike.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow.traced import traced


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


def traces(function, specs) -> bool:
    """Whether `function` traces for `specs`; False where tracing raises (a length read as a
    Python int, or a genuine error, which the trace at the data's shapes raises again)."""
    try:
        function.get_concrete_function(*specs)
    except Exception:  # noqa: BLE001 - the caller traces at the data's shapes instead
        return False
    return True


class Traces:
    """How a runner's step functions are traced: each once, before its first call, with the
    batch size and the declared varying dimensions unknown, or, where that trace raises, per
    length (module docstring). `declared`: the inputs' declared shapes
    (`declared_shapes`); None traces every function as the data comes (`reduce_retracing`)."""

    def __init__(self, declared: list[tuple] | None):
        self.declared = declared
        self._fallbacks: dict[int, tuple] = {}  # id(function) -> (function, its _ByLength)

    def ready(self, function, args: tuple, targets: tuple = ()):
        """What to call for `function(*args)`: `function` (a `tf.function`), traced once with
        the batch size and varying lengths unknown, or, once that trace raised, a copy traced
        for `args`' lengths. `args[0]` are the inputs; `targets` are the positions of targets
        and sample weights."""
        if self.declared is None:
            return function
        entry = self._fallbacks.get(id(function))
        if entry is None:
            if function.experimental_get_tracing_count() > 0:
                return function
            if traces(function, relaxed_specs(args, self.declared, targets)):
                return function
            entry = self._fallbacks[id(function)] = (function, _ByLength(function))
        return entry[1].ready(args, self.declared, targets)

    def tracing_count(self, function) -> int:
        """How often `function` was traced, its fallback's traces included."""
        entry = self._fallbacks.get(id(function))
        fallback = 0 if entry is None else entry[1].function.experimental_get_tracing_count()
        return function.experimental_get_tracing_count() + fallback


class _ByLength:
    """A step function whose relaxed trace raised: its copy without `reduce_retracing`, traced
    once per distinct set of lengths with the batch size unknown, or, once such a trace raised,
    at each call's shapes (where a genuine error raises)."""

    def __init__(self, function):
        # reduce_retracing would relax a length again at the second one
        self.function = traced(function.python_function)
        self._batch_unknown = True
        self._lengths: set[tuple] = set()  # the shapes traced, the batch size left out

    def ready(self, args: tuple, declared: list[tuple], targets: tuple):
        if not self._batch_unknown:
            return self.function  # traced by shape as it is called
        specs = relaxed_specs(args, declared, targets, lengths=False)
        key = _shapes(specs, targets)
        if key not in self._lengths:
            if not traces(self.function, specs):
                self._batch_unknown = False
                return self.function
            self._lengths.add(key)
        return self.function


def _shapes(specs: list, targets: tuple) -> tuple:
    """The shapes of the inputs (`specs[0]`) and `targets` in `specs`, as a key."""
    leaves = tree.flatten([specs[0], *(specs[p] for p in targets)])
    return tuple(tuple(leaf.shape) if hasattr(leaf, "shape") else leaf for leaf in leaves)


def relaxed_specs(
    args: tuple, declared: list[tuple], targets: tuple = (), lengths: bool = True
) -> list:
    """`args` with the inputs (`args[0]`, `declared`: their shapes) and `targets` as specs that
    leave unknown what varies (`Traces`); with `lengths=False`, the batch size only."""
    specs = list(args)
    specs[0] = _input_specs(args[0], declared, lengths)
    for position in targets:
        specs[position] = tree.map_structure(
            functools.partial(_target_spec, lengths=lengths), args[position]
        )
    return specs


def _input_specs(inputs, declared: list[tuple], lengths: bool):
    leaves = tree.flatten(inputs)
    if len(leaves) != len(declared):  # not the declared structure: trace as the data comes
        return inputs
    specs = [_spec(leaf, shape, lengths) for leaf, shape in zip(leaves, declared, strict=True)]
    return tree.pack_sequence_as(inputs, specs)


def _spec(value, declared: tuple, lengths: bool) -> tf.TensorSpec:
    """`value`'s spec with the dimensions `declared` None unknown (the first only, without
    `lengths`)."""
    shape = tuple(value.shape)
    if len(shape) != len(declared):
        return tf.TensorSpec(shape, _dtype(value))
    dims = [
        None if want is None and (lengths or axis == 0) else have
        for axis, (want, have) in enumerate(zip(declared, shape, strict=True))
    ]
    return tf.TensorSpec(dims, _dtype(value))


def _target_spec(value, lengths: bool = True):
    if value is None:
        return None
    shape = np.shape(value)
    if lengths or not shape:
        return tf.TensorSpec((None,) * len(shape), _dtype(value))
    return tf.TensorSpec((None, *shape[1:]), _dtype(value))


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
        shape=tf.get_static_value(value.dense_shape),
        dtype=value.values.dtype,
        indices_dtype=value.indices.dtype,
        dense_shape_dtype=value.dense_shape.dtype,
        indices_shape=[None],
    )
