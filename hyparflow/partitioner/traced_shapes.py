"""Which tensors of a layer graph may cross a stage boundary: their traced shapes.

A pipeline sends a boundary tensor in slices of the batch, each received into a stage input of
the shape Keras declares for it. Two kinds of tensor cannot travel that way: one that does not
follow the batch (a position table computed once per batch), and one whose layer declares
another shape than it computes (keras_hub 0.32's `MoonshineRotaryEmbedding` declares
`(batch,)` and computes `(length, dim)`). Tracing the graph once at a batch size that other
dimensions are unlikely to equal shows both; the partitioner then begins no stage where such
a tensor is alive. A graph that cannot be traced without its data's lengths (a layer reading a
length as a Python int) tells nothing here, and its boundaries are checked per message, as
before.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
import tensorflow as tf

from hyparflow.partitioner.graph import LayerGraph
from hyparflow.partitioner.profile import node_call
from hyparflow.traced import traced

PROBE_BATCH = 7  # prime, and unlike the lengths and widths models are built with


class Unsendable(NamedTuple):
    """Why a tensor cannot cross a stage boundary, and whether the trace proves it: a batch
    traced as unknown (a reshape to -1 rows at unknown lengths) only may be another dimension."""

    reason: str
    certain: bool


def unsendable_tensors(graph: LayerGraph) -> dict[int, Unsendable]:
    """Tensor index -> why it cannot cross a stage boundary (its traced shape against its
    declared one), for every tensor a trace of `graph` shows; empty where the trace fails.
    Kept on the model: a graph of it numbers its tensors alike, and a large model's trace
    takes seconds, which every split of it (the planner makes dozens) would repeat."""
    kept = getattr(graph.model, _KEPT, None)
    if kept is None:
        kept = _unsendable(graph)
        object.__setattr__(graph.model, _KEPT, kept)  # not a tracked attribute
    return dict(kept)


_KEPT = "_hyparflow_unsendable_tensors"


def _unsendable(graph: LayerGraph) -> dict[int, Unsendable]:
    inputs = [graph.tensors[t].keras_tensor for t in graph.inputs]
    if any(kt.sparse or getattr(kt, "ragged", False) for kt in inputs):
        return {}
    batch = _batch_size(inputs)
    specs = [tf.TensorSpec((batch, *kt.shape[1:]), kt.dtype) for kt in inputs]
    found = {}
    for t, shape in _traced_shapes(graph, specs).items():
        unsendable = why_unsendable(tuple(graph.tensors[t].keras_tensor.shape), shape, batch)
        if unsendable is not None:
            found[t] = unsendable
    return found


def why_unsendable(declared: tuple, traced_shape: tuple, batch: int) -> Unsendable | None:
    """Why a tensor declared `declared` and traced `traced_shape` (at `batch` samples) cannot
    travel in slices of the batch, or None where it can (unknown dimensions agree with any,
    but the batch's own).

    Example:
        >>> why_unsendable((None, 16), (7, 16), 7) is None
        True
        >>> why_unsendable((None,), (None, 4), 7).reason
        'declared (None,) but computed (None, 4), not 7 samples first'
        >>> why_unsendable((None,), (None, 4), 7).certain
        True
        >>> why_unsendable((None, 4), (None, 4), 7).certain
        False
    """
    agrees = (
        len(traced_shape) == len(declared) > 0
        and traced_shape[0] in (batch, None)
        and all(
            d is None or s is None or d == s
            for d, s in zip(declared[1:], traced_shape[1:], strict=True)
        )
    )
    if agrees and traced_shape[0] == batch:
        return None
    reason = f"declared {declared} but computed {traced_shape}, not {batch} samples first"
    return Unsendable(reason, certain=not agrees)


def _batch_size(inputs) -> int:
    """A model fixing its batch (`keras.Input(batch_shape=...)`) is traced at that batch."""
    fixed = {kt.shape[0] for kt in inputs if kt.shape and kt.shape[0] is not None}
    return fixed.pop() if len(fixed) == 1 else PROBE_BATCH


def _traced_shapes(graph: LayerGraph, specs: list) -> dict[int, tuple]:
    """Every node output's static shape in one trace of the graph for `specs` (never run)."""
    try:
        found = traced_specs(graph, specs)
    except Exception:  # noqa: BLE001 - a length read as a Python int: nothing known here
        return {}
    return {t: tuple(spec.shape.as_list()) for t, spec in found.items() if t not in graph.inputs}


def traced_specs(graph: LayerGraph, specs: list) -> dict[int, tf.TensorSpec]:
    """Every tensor's static shape and dtype (the inputs' `specs`, then each node output's)
    in one trace of the graph (never run: a model built under hf.scope() reads placeholders,
    so no weight is allocated; a stateless scope keeps its variables unassigned). Raises what
    the trace raises."""
    found = dict(zip(graph.inputs, specs, strict=True))

    def forward(*inputs):
        values = dict(zip(graph.inputs, inputs, strict=True))
        for node in graph.nodes:
            outputs = node_call(node)([values[t] for t in node.inputs])
            values.update(zip(node.outputs, outputs, strict=True))
            for t, output in zip(node.outputs, outputs, strict=True):
                if hasattr(output, "shape"):
                    found[t] = tf.TensorSpec(output.shape, output.dtype)
        return []

    with keras.StatelessScope():  # a Dropout's seed update is recorded, not assigned
        traced(forward).get_concrete_function(*specs)
    return found
