"""What each layer call would exchange if tensor ranks split it, found by running it once.

Megatron's conjugate collectives (`tensor/collectives.py`) move whole activations: a row
layer's output is summed over the ranks in the forward (g), a column layer's input gradient in
the backward (f), an attention layer copies each distinct input once (its gradient summed), a
vocabulary layer sums its lookups and gathers its logits. Each node of the model's graph runs
once, eagerly, with the calls of the layers `tensor_layout` splits wrapped to count the bytes
at those points; with the bytes of the split variables that is each node's `TensorShare`, what
the scaling model needs to price tensor ranks (`auto/tensor_price.py`).
"""

from __future__ import annotations

import contextlib
import inspect
import math

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow.engine.weights import nbytes
from hyparflow.intercept import instead, replaced_calls
from hyparflow.partitioner import profile
from hyparflow.partitioner.graph import numpy_dtype
from hyparflow.simulate.costs import TensorShare
from hyparflow.tensor.splits import COLUMN, ROW, VOCAB
from hyparflow.traced import traced

# an all-gather sends each rank (T-1)/T of the result, half what a ring allreduce of it sends
GATHER_SHARE = 0.5


FORWARD, BACKWARD = 0, 1


class _Tally:
    """Bytes and collectives counted per node while the graph runs, forward and backward.
    No gradient flows into the node's `free` inputs (none of their producers has trainable
    weights), so copying one of them (as it is, or cast by Keras) sums nothing backward."""

    def __init__(self, nodes: int):
        self.node, self.free = 0, []
        self.bytes = np.zeros((nodes, 2))
        self.calls = np.zeros((nodes, 2), int)

    def add(self, direction: int, tensor, share: float = 1.0) -> None:
        if direction == BACKWARD and any(_same_values(tensor, x) for x in self.free):
            return
        self.bytes[self.node, direction] += share * _wire_bytes(tensor)
        self.calls[self.node, direction] += 1


def tensor_shares(graph, layout, inputs: list, traced_only: bool = False) -> list[TensorShare]:
    """Each node's `TensorShare` under `layout` (a `TensorLayout` of `graph`'s model), per
    sample of `inputs` (a batch of the model's inputs). `traced_only`: the graph is traced at
    the inputs' shapes, not run (a model built under hf.scope() holds no weights to run; the
    bytes are the same, but a cast copy of an input without gradient then counts)."""
    batch = int(inputs[0].shape[0])
    tally = _Tally(len(graph.nodes))
    if traced_only:
        specs = [tf.TensorSpec(x.shape, x.dtype) for x in inputs]
        walk = traced(lambda *xs: _walk(graph, layout, list(xs), tally))
        with keras.StatelessScope():  # a Dropout's seed update is recorded, not assigned
            walk.get_concrete_function(*specs)
    else:
        with profile.preserved_state(graph.model):
            _walk(graph, layout, inputs, tally)
    split = {id(v): v for s in layout.splits for v, _ in s.axes.values()}
    shares, seen = [], set()
    for node in graph.nodes:
        variables = list(getattr(node.operation, "trainable_variables", []))
        whole = sum(nbytes(v) for v in variables)
        parted = sum(nbytes(v) for v in variables if id(v) in split)
        first = id(node.operation) not in seen
        seen.add(id(node.operation))
        forward, backward = tally.bytes[node.position] / batch
        calls = tally.calls[node.position]
        shares.append(
            TensorShare(
                parted if first else 0,
                parted / whole if whole else 0.0,
                float(forward),
                float(backward),
                int(calls[0]),
                int(calls[1]),
            )
        )
    return shares


def _walk(graph, layout, inputs: list, tally: _Tally) -> list:
    """Run (or trace) every node once, counting the exchanges of its split layers."""
    trained = _trained_tensors(graph)
    with _counting(layout, tally):
        for node, values in profile.node_inputs_in_order(graph, inputs):
            tally.node = node.position  # the node runs when the walk resumes
            tally.free = [v for t, v in zip(node.inputs, values, strict=True) if t not in trained]
    return []


def _trained_tensors(graph) -> set[int]:
    """The graph's tensors that a trainable weight reaches, so that they take a gradient."""
    trained = set()
    for node in graph.nodes:  # in order: producers first
        weighted = bool(getattr(node.operation, "trainable_variables", None))
        if weighted or any(t in trained for t in node.inputs):
            trained.update(node.outputs)
    return trained


def _same_values(tensor, other) -> bool:
    """Whether `tensor` is `other`, or `other` cast (Keras casts a layer's inputs)."""
    if tensor is other:
        return True
    if tuple(tensor.shape) != tuple(other.shape) or not hasattr(other, "numpy"):
        return False
    values = np.asarray(tensor)
    return bool(np.array_equal(values, np.asarray(other).astype(values.dtype)))


@contextlib.contextmanager
def _counting(layout, tally: _Tally):
    """The calls of `layout`'s split layers (and of the attention layers that copy their
    inputs) count their exchanges into `tally`, as `TensorShards.active()` would run them."""
    wrapped = [(s.layer, _split_call(s, tally)) for s in layout.splits]
    wrapped += [(layer, _copying_call(layer, names, tally)) for layer, names in layout.copies]
    with replaced_calls((layer, instead(call)) for layer, call in wrapped):
        yield


def _split_call(split, tally: _Tally):
    original = type(split.layer).call.__get__(split.layer)

    def call(inputs, *args, **kwargs):
        outputs = original(inputs, *args, **kwargs)
        if split.role == COLUMN and not split.input_copied:
            tally.add(BACKWARD, inputs)
        elif split.role == ROW:
            tally.add(FORWARD, outputs)
        elif split.role == VOCAB and kwargs.get("reverse"):  # the tied output projection
            tally.add(BACKWARD, inputs)
            tally.add(FORWARD, outputs, GATHER_SHARE)
        elif split.role == VOCAB:
            tally.add(FORWARD, outputs)
        return outputs

    return call


def _copying_call(layer, names, tally: _Tally):
    original = type(layer).call.__get__(layer)
    signature = inspect.signature(original)

    def call(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        distinct = {id(v): v for n in names if (v := bound.arguments.get(n)) is not None}
        for value in distinct.values():
            tally.add(BACKWARD, value)
        return original(*args, **kwargs)

    return call


def _wire_bytes(value) -> int:
    """Bytes of a tensor as MPI moves them (a structure of them: summed); floats
    narrower than float32 travel as float32 (`comm/in_graph.py`)."""
    total = 0
    for x in tree.flatten(value):
        dtype = keras.backend.standardize_dtype(x.dtype)
        size = 4 if dtype in ("float16", "bfloat16") else np.dtype(numpy_dtype(dtype)).itemsize
        total += math.prod(int(d) for d in x.shape) * size
    return total
