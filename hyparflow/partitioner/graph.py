"""The user's Keras model as a flat DAG of operation calls, in a topological order."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import keras
import numpy as np
from keras import tree

from hyparflow import _keras

# Keras records a nested model's call with these keyword arguments; with any other value the
# nested model is kept as one node, so that Keras's own handling of them stays exact.
_FLATTENABLE_CALL_KWARGS = frozenset({"training", "mask"})

NOT_GRAPH_MESSAGE = (
    "Model parallelism needs a functional or Sequential Keras model (a graph of layer calls); "
    "got {kind}. Rewrite the model with the functional API or keras.Sequential, or train it "
    'with strategy="data", which works for any model.'
)


@dataclass
class GraphTensor:
    """A tensor flowing between nodes: produced by one node (or a model input), read by others."""

    index: int
    name: str
    keras_tensor: object  # reference KerasTensor of the user's graph: shape and dtype
    producer: int  # position of the producing node; -1 for a model input
    consumers: list[int] = field(default_factory=list)

    @property
    def shape(self) -> tuple:
        """Shape without the batch dimension (None where unknown)."""
        return tuple(self.keras_tensor.shape[1:])

    @property
    def dtype(self) -> str:
        return str(self.keras_tensor.dtype)

    @property
    def bytes_per_sample(self) -> int:
        """Bytes of one sample of this tensor; unknown dimensions count as 1."""
        elements = math.prod(1 if d is None else int(d) for d in self.shape)
        return elements * np.dtype(numpy_dtype(self.dtype)).itemsize


@dataclass
class GraphNode:
    """One call of one operation (a layer, a `keras.ops` call or an opaque nested model)."""

    position: int
    name: str  # unique: the layer name, plus "#k" when the layer is called several times
    layer_name: str  # the operation's name, qualified by nested models ("block/conv")
    operation: object
    arguments: object  # keras SymbolicArguments of the recorded call
    argument_tensors: dict[int, int]  # id(KerasTensor in arguments) -> tensor index
    inputs: list[int]  # distinct tensor indices read, in argument order
    outputs: list[int]  # tensor indices written, in the order Keras flattens outputs
    is_layer: bool


@dataclass
class LayerGraph:
    """Flat DAG of a model: nodes in topological order, tensors, model inputs and outputs."""

    model: object  # the user's model
    root: object  # the Functional that runs it (the Sequential's inner one for Sequential)
    nodes: list[GraphNode]
    tensors: list[GraphTensor]
    inputs: list[int]  # tensor indices of `model.inputs`, in order
    outputs: list[int]  # tensor indices of `model.outputs`, in order (may repeat)

    def last_use(self) -> np.ndarray:
        """Per tensor, the last node position reading it; len(nodes) for model outputs."""
        last = np.full(len(self.tensors), -1, dtype=np.int64)
        for tensor in self.tensors:
            if tensor.consumers:
                last[tensor.index] = max(tensor.consumers)
        last[self.outputs] = len(self.nodes)
        return last

    def masked_cuts(self) -> set[int]:
        """Positions where no stage may begin: a tensor carrying a Keras mask (e.g. after
        `Embedding(mask_zero=True)`) is alive across them, and a mask is metadata that only
        travels with its tensor inside one Keras call, so cutting there would drop it."""
        masked = [t.index for t in self.tensors if _keras.keras_mask(t.keras_tensor) is not None]
        return self.alive_across(masked)

    def alive_across(self, tensor_ids) -> set[int]:
        """Positions where a stage beginning would have to receive one of `tensor_ids`: from
        after each one's producer to its last reader (the end, for a model output)."""
        last = self.last_use()
        cuts = set()
        for t in tensor_ids:
            end = min(int(last[t]), len(self.nodes) - 1)
            cuts.update(range(max(self.tensors[t].producer, 0) + 1, end + 1))
        return cuts


def root_functional(model):
    """The Functional graph that computes `model`, or a ValueError saying what to change."""
    if isinstance(model, keras.Sequential):
        if type(model).call is not keras.Sequential.call:
            raise ValueError(NOT_GRAPH_MESSAGE.format(kind=_kind(model)))
        if _keras.inner_functional(model) is None:
            raise ValueError(
                f"Sequential model '{model.name}' is not built, so its layer graph is unknown. "
                "Build it first: start it with keras.Input(shape), or call "
                "model.build((None, *input_shape)), or call it once on a batch."
            )
        return _keras.inner_functional(model)
    if isinstance(model, _keras.Functional):
        if type(model).call is not _keras.Functional.call:
            raise ValueError(NOT_GRAPH_MESSAGE.format(kind=_kind(model) + " overriding call()"))
        return model
    raise ValueError(NOT_GRAPH_MESSAGE.format(kind=_kind(model)))


def build_graph(model) -> LayerGraph:
    """Flatten `model` (nested Functional/Sequential models inlined) into a `LayerGraph`.

    Iterative throughout: graph depth never becomes Python recursion depth.
    """
    root = root_functional(model)
    leaves = _leaf_operations(root)
    builder = _Builder(clashing={name for name, ids in leaves.items() if len(ids) > 1})
    mapping = {id(kt): builder.add_model_input(kt) for kt in root.inputs}
    builder.expand(root, "", mapping)
    outputs = [mapping[id(kt)] for kt in root.outputs]
    nodes, tensors = _prune_dead(builder.nodes, builder.tensors, outputs)
    nodes, tensors = _order_depth_first(nodes, tensors)
    _name_nodes_and_tensors(nodes, tensors)
    inputs = [mapping[id(kt)] for kt in root.inputs]
    return LayerGraph(model, root, nodes, tensors, inputs, outputs)


class _Builder:
    """Collects nodes and tensors while walking Keras graphs, inlining nested models (those
    that hold none of the `clashing` names)."""

    def __init__(self, clashing: set[str]):
        self.clashing = clashing
        self.nodes: list[GraphNode] = []
        self.tensors: list[GraphTensor] = []

    def add_model_input(self, keras_tensor) -> int:
        name = _keras.producer_name(keras_tensor)
        return self._add_tensor(name, keras_tensor, producer=-1)

    def _add_tensor(self, name, keras_tensor, producer) -> int:
        index = len(self.tensors)
        self.tensors.append(GraphTensor(index, name, keras_tensor, producer))
        return index

    def expand(self, functional, prefix, mapping):
        """Add the nodes of `functional`; `mapping` (id of KerasTensor -> tensor index) must
        cover its inputs and receives every tensor it computes.

        Nested models push their own walk on an explicit stack instead of recursing.
        """
        # entries: (remaining Keras nodes, name prefix, tensor mapping, outer call or None)
        stack = [(_nodes_in_order(functional), prefix, mapping, None)]
        while stack:
            keras_nodes, prefix, mapping, outer_call = stack[-1]
            keras_node = next(keras_nodes, None)
            if keras_node is None:
                stack.pop()
                if outer_call is not None:  # map the nested call's outputs to inner results
                    outer_node, inner, outer_mapping = outer_call
                    for outer_kt, inner_kt in zip(outer_node.outputs, inner.outputs, strict=True):
                        outer_mapping[id(outer_kt)] = mapping[id(inner_kt)]
                continue
            if keras_node.is_input:
                continue  # an input of this (sub)graph, already mapped
            inner = _flattenable_model(keras_node)
            if inner is not None and self.clashing and self.clashing & set(_leaf_operations(inner)):
                inner = None  # its layers' names repeat elsewhere: keras.Model needs them unique
            if inner is None:
                self._add_leaf(keras_node, prefix, mapping)
                continue
            inner_mapping = {
                id(inner_kt): mapping[id(outer_kt)]
                for inner_kt, outer_kt in zip(
                    inner.inputs, _call_inputs(keras_node, inner), strict=True
                )
            }
            inner_prefix = f"{prefix}{keras_node.operation.name}/"
            outer_call = (keras_node, inner, mapping)
            stack.append((_nodes_in_order(inner), inner_prefix, inner_mapping, outer_call))

    def _add_leaf(self, keras_node, prefix, mapping):
        position = len(self.nodes)
        argument_tensors = {id(kt): mapping[id(kt)] for kt in keras_node.arguments.keras_tensors}
        inputs = list(dict.fromkeys(argument_tensors[id(kt)] for kt in keras_node.input_tensors))
        operation = keras_node.operation
        layer_name = prefix + operation.name
        outputs = []
        for kt in keras_node.outputs:
            index = self._add_tensor(layer_name, kt, producer=position)
            mapping[id(kt)] = index
            outputs.append(index)
        for index in inputs:
            self.tensors[index].consumers.append(position)
        is_layer = isinstance(operation, keras.layers.Layer)  # keras.ops calls are not
        self.nodes.append(
            GraphNode(
                position,
                layer_name,
                layer_name,
                operation,
                keras_node.arguments,
                argument_tensors,
                inputs,
                outputs,
                is_layer,
            )
        )


def _nodes_in_order(functional):
    """Keras nodes of `functional` from inputs to outputs (decreasing depth is topological)."""
    by_depth = _keras.nodes_by_depth(functional)
    return iter([node for depth in sorted(by_depth, reverse=True) for node in by_depth[depth]])


def _leaf_operations(functional) -> dict[str, set[int]]:
    """The operations a graph of `functional` would hold with every nested model inlined, by
    name (ids: distinct operations). Two keras_hub encoders side by side (CLIP's) both hold an
    "embedding": keras.Model refuses a stage holding both, so `expand` keeps each nested model
    that holds a repeated name as one node."""
    found: dict[str, set[int]] = {}
    stack = [functional]
    while stack:
        for keras_node in _nodes_in_order(stack.pop()):
            if keras_node.is_input:
                continue
            inner = _flattenable_model(keras_node)
            if inner is None:
                found.setdefault(keras_node.operation.name, set()).add(id(keras_node.operation))
            else:
                stack.append(inner)
    return found


def _flattenable_model(keras_node):
    """The Functional to inline for a call of a nested model, or None to keep it one node."""
    operation = keras_node.operation
    if isinstance(operation, keras.Sequential) and type(operation).call is keras.Sequential.call:
        inner = _keras.inner_functional(operation)
    elif (
        isinstance(operation, _keras.Functional) and type(operation).call is _keras.Functional.call
    ):
        inner = operation
    else:
        return None
    if inner is None:
        return None
    kwargs = keras_node.arguments.kwargs
    if any(
        k not in _FLATTENABLE_CALL_KWARGS or any(x is not None for x in tree.flatten(v))
        for k, v in kwargs.items()
    ):
        return None  # e.g. training=False, an explicit mask: keep Keras's semantics exactly
    if len(keras_node.arguments.args) != 1:
        return None
    if _call_inputs(keras_node, inner) is None:
        return None
    if len(keras_node.outputs) != len(inner.outputs):
        return None
    return inner


def _call_inputs(keras_node, inner):
    """The outer KerasTensors fed to `inner.inputs`, in that order, or None if unclear."""
    argument = keras_node.arguments.args[0]
    structure = _keras.inputs_structure(inner)
    if isinstance(argument, dict) and not isinstance(structure, dict):
        by_name = {kt.name: kt for kt in tree.flatten(structure)}
        if set(argument) != set(by_name):
            return None
        order = {name: i for i, name in enumerate(kt.name for kt in inner.inputs)}
        flat = [argument[name] for name in sorted(argument, key=order.__getitem__)]
    else:
        flat = tree.flatten(argument)
    if len(flat) != len(inner.inputs) or not all(map(_keras.is_keras_tensor, flat)):
        return None
    return flat


def _prune_dead(nodes, tensors, outputs):
    """Drop nodes none of whose results reach a model output (unused outputs of nested
    models); the stage sub-models would not compute them either."""
    needed_tensors = set(outputs)
    live = [False] * len(nodes)
    for node in reversed(nodes):  # nodes are topological, so consumers come first here
        if any(t in needed_tensors for t in node.outputs):
            live[node.position] = True
            needed_tensors.update(node.inputs)
    if all(live):
        return nodes, tensors
    kept = [node for node in nodes if live[node.position]]
    for tensor in tensors:
        tensor.consumers = [c for c in tensor.consumers if live[c]]
    return _renumber(kept, tensors)


def _order_depth_first(nodes, tensors):
    """Re-sort topologically, running a node's consumers as soon as they are ready.

    Kahn's algorithm with a stack: one branch is followed to its merge before the next starts,
    so few tensors are alive at any point and contiguous stage cuts send little. Among nodes
    ready together the one closest to a model output runs first, so that a side head (an
    auxiliary classifier) is computed where its input is, instead of that input being
    forwarded to the last stage.
    """
    consumers_of = [
        list(dict.fromkeys(c for t in node.outputs for c in tensors[t].consumers)) for node in nodes
    ]
    to_output = [0] * len(nodes)  # longest path to a model output, in nodes
    for node in reversed(nodes):
        to_output[node.position] = max(
            (to_output[c] + 1 for c in consumers_of[node.position]), default=0
        )
    pending = [0] * len(nodes)
    for node in nodes:
        pending[node.position] = len({tensors[t].producer for t in node.inputs} - {-1})

    def push_in_turn(positions):  # the last pushed (closest to an output) is popped first
        ready.extend(sorted(positions, key=lambda p: (-to_output[p], -p)))

    ready = []
    push_in_turn([node.position for node in nodes if pending[node.position] == 0])
    order = []
    while ready:
        position = ready.pop()
        order.append(nodes[position])
        newly_ready = []
        for consumer in consumers_of[position]:
            pending[consumer] -= 1
            if pending[consumer] == 0:
                newly_ready.append(consumer)
        push_in_turn(newly_ready)
    assert len(order) == len(nodes), "the Keras graph has a cycle"
    return _renumber(order, tensors)


def _renumber(ordered_nodes, tensors):
    """Give nodes positions 0..n-1 in the given order and update tensor references."""
    new_position = {node.position: i for i, node in enumerate(ordered_nodes)}
    for i, node in enumerate(ordered_nodes):
        node.position = i
    for tensor in tensors:
        if tensor.producer >= 0:
            tensor.producer = new_position.get(tensor.producer, -2)
        tensor.consumers = sorted(new_position[c] for c in tensor.consumers)
    return ordered_nodes, tensors


def _name_nodes_and_tensors(nodes, tensors):
    """Unique names: "#k" tells apart the calls of a shared layer, ":i" a node's outputs."""
    canonical = {}  # a layer reached through two nested models keeps its first name
    for node in nodes:
        node.layer_name = canonical.setdefault(id(node.operation), node.layer_name)
    calls = {}
    for node in nodes:
        calls[node.layer_name] = calls.get(node.layer_name, 0) + 1
    seen = {}
    for node in nodes:
        if calls[node.layer_name] > 1:
            k = seen.get(node.layer_name, 0)
            seen[node.layer_name] = k + 1
            node.name = f"{node.layer_name}#{k}"
        for i, t in enumerate(node.outputs):
            tensors[t].name = node.name if len(node.outputs) == 1 else f"{node.name}:{i}"


def _kind(model) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def numpy_dtype(dtype: str) -> str:
    """A NumPy dtype of the same size as Keras dtype `dtype` (bfloat16 has none)."""
    return {"bfloat16": "float16", "string": "object"}.get(dtype, dtype)


def safe_name(name: str) -> str:
    """`name` with only characters Keras accepts in layer names."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
