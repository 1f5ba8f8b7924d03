"""The first trace of a step over data of varying length already leaves those lengths unknown.

Keras's train function is a `tf.function(reduce_retracing=True)`: its second call with another
sequence length traces again with the lengths that differ unknown, and never again. A model
declares which dimensions of its inputs vary (None in `model.input`, or in what a pipeline stage
receives), so a runner can trace once, before its first call, with exactly those unknown: one
trace instead of two, and for a large model one long trace less in the first epoch. The batch
size stays known, as in Keras's first trace (Keras's per-output loss trackers weight each batch
by its static size). Targets and sample weights have no declared shape: every dimension after
the batch is left unknown, as a `tf.data` input of unknown shapes gives Keras's fit.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from keras import tree


def declared_shapes(model, stage) -> list[tuple] | None:
    """The declared shape (batch dimension left out) of each flattened input of `stage` (or of
    the whole `model`, in `tree.flatten` order of its inputs), or None when no dimension varies."""
    if stage is not None:
        shapes = [tuple(t.shape) for t in stage.receives]  # without the batch dimension
    else:
        shapes = [tuple(t.shape)[1:] for t in tree.flatten(_model_input(model))]
    return shapes if any(d is None for shape in shapes for d in shape) else None


def _model_input(model):
    """`model.input` (the structure a call takes), or nothing for a model without one."""
    try:
        return model.input
    except (AttributeError, ValueError):  # subclassed, or not built on inputs
        return []


def trace_first(function, args: tuple, declared: list[tuple], targets: tuple = ()) -> None:
    """Trace `function` (a `tf.function`) for `args` with the varying dimensions unknown, unless
    it has been traced before. `args[0]` are the inputs (`declared`: their shapes, by
    `declared_shapes`); `targets` are the positions of targets and sample weights."""
    if function.experimental_get_tracing_count() > 0:
        return
    specs = list(args)
    specs[0] = _input_specs(args[0], declared)
    for position in targets:
        specs[position] = tree.map_structure(_target_spec, args[position])
    function.get_concrete_function(*specs)


def _input_specs(inputs, declared: list[tuple]):
    leaves = tree.flatten(inputs)
    if len(leaves) != len(declared):  # not the declared structure: trace as the data comes
        return inputs
    specs = [_spec(leaf, shape) for leaf, shape in zip(leaves, declared, strict=True)]
    return tree.pack_sequence_as(inputs, specs)


def _spec(value, declared: tuple) -> tf.TensorSpec:
    """`value`'s spec with the dimensions `declared` None unknown (its batch size kept)."""
    shape = tuple(value.shape)
    if len(shape) != len(declared) + 1:
        return tf.TensorSpec(shape, _dtype(value))
    dims = [
        shape[0],
        *(None if want is None else have for want, have in zip(declared, shape[1:], strict=True)),
    ]
    return tf.TensorSpec(dims, _dtype(value))


def _target_spec(value):
    if value is None:
        return None
    shape = tuple(np.shape(value))
    return tf.TensorSpec(shape[:1] + (None,) * (len(shape) - 1), _dtype(value))


def _dtype(value) -> tf.DType:
    return tf.as_dtype(value.dtype)
