"""The tensor layout of a model: which layers split, which way, and what stays whole.

Megatron-LM's pairs (Shoeybi et al., "Megatron-LM", 2019): a column-parallel layer splits its
output units and the next, row-parallel one its input units, so the activation between them
stays split and one allreduce after the pair restores it. The automatic rules find:

- Dense/Conv pairs in the model's graph: a Dense or channels-last Conv whose output goes, only
  through elementwise layers (activations, dropout, pooling), to one more Dense or Conv;
- attention by heads: a `MultiHeadAttention`'s query, key and value projections by column,
  its output projection by row;
- the feed-forward pair of keras_hub's `TransformerEncoder` and `TransformerDecoder`;
- embeddings by vocabulary rows, a tied output projection (`ReversibleEmbedding`) included.

A `tensor_layout` mapping (Keras `LayoutMap` convention) replaces the automatic rules. What no
rule splits stays replicated; the layout records why, for its summary.
"""

from __future__ import annotations

import keras

from hyparflow import _keras
from hyparflow.partitioner.graph import build_graph
from hyparflow.tensor.keras_hub_blocks import (
    split_block,
    split_head_norms,
    splits_by_heads,
    whole_tensor_dropouts,
)
from hyparflow.tensor.layout import check_divides, lookup, split_axis
from hyparflow.tensor.roles import (
    CONVS,
    ELEMENTWISE_ACTIVATIONS,
    check_elementwise,
    split_layer,
    unsplittable,
)
from hyparflow.tensor.splits import COLUMN, ROW, VOCAB, TensorLayout

_POOLING = (
    keras.layers.MaxPooling1D,
    keras.layers.MaxPooling2D,
    keras.layers.MaxPooling3D,
    keras.layers.AveragePooling1D,
    keras.layers.AveragePooling2D,
    keras.layers.AveragePooling3D,
    keras.layers.GlobalAveragePooling1D,
    keras.layers.GlobalAveragePooling2D,
    keras.layers.GlobalAveragePooling3D,
    keras.layers.GlobalMaxPooling1D,
    keras.layers.GlobalMaxPooling2D,
    keras.layers.GlobalMaxPooling3D,
)


def tensor_layout(model, parts: int, overrides: dict | None = None) -> TensorLayout:
    """The layout of `model` (a whole model or a stage's sub-model) over `parts` ranks:
    `overrides` (a LayoutMap-style dict) when given, else the automatic rules."""
    layout = TensorLayout(parts, variables=list(model.trainable_variables))
    if parts == 1:
        return layout
    layers = _keras.all_layers(model, include_self=False)
    graph = _graph_of(model)  # None for a subclassed model: only the rules by layer type apply
    if overrides is not None:
        _apply_overrides(layout, layers, overrides, graph)
    else:
        _attention_and_embeddings(layout, layers)
        _graph_pairs(layout, graph)
        _note_unpaired(layout, graph)
    _check_composite_dropouts(layout, layers)
    layout.summed = split_head_norms(layout, layers)
    for split in layout.splits:
        for variable, _ in split.axes.values():
            check_elementwise(variable)
    order = {id(v): i for i, v in enumerate(layout.variables)}
    layout.splits.sort(key=lambda s: min(order.get(k, len(order)) for k in s.axes))
    return layout


def _attention_and_embeddings(layout: TensorLayout, layers) -> None:
    parts = layout.parts
    for layer in layers:
        if isinstance(layer, keras.layers.Embedding):
            why = unsplittable(layer)
            if why:
                layout.replicated.append(f"{layer.name}: {why}")
                continue
            with layout.all_or_none(layer.name, [layer]):
                layout.splits.append(split_layer(layer, VOCAB, parts, "vocabulary rows"))
        elif isinstance(layer, keras.layers.MultiHeadAttention):
            if not splits_by_heads(layer):
                why = f"{type(layer).__name__} computes its own attention (its call overridden)"
                layout.keep_whole(layer.name, [layer], why)
                continue
            with layout.all_or_none(layer.name, [layer]):
                _split_attention(layout, layer)
        else:
            split_block(layout, layer)


def _split_attention(layout: TensorLayout, layer) -> None:
    """Query, key, value (and gate) by column over the heads, output by row."""
    heads, parts = layer.num_heads, _keras.attention_parts(layer)
    if parts["axes"] not in ((), (1,)):
        layout.keep_whole(layer.name, [layer], f"it attends over axes {parts['axes']}")
        return
    check_divides(layer.name, "attention heads", heads, layout.parts)
    reason = f"{heads} heads of {layer.name}"
    for name in ("query", "key", "value", "gate"):
        dense = parts[name]
        if dense is not None:
            axis = list(_keras.kernel_variable(dense).shape).index(heads, 1)
            split = split_layer(dense, COLUMN, layout.parts, reason, heads_axis=axis)
            split.input_copied = True
            layout.splits.append(split)
    layout.splits.append(split_layer(parts["output"], ROW, layout.parts, reason))
    layout.copies.append((layer, ("query", "value", "key")))
    if parts["rate"] > 0:
        layout.dropouts.append((parts["dropout"], 1))  # scores: (batch, heads, query, key)


# --- pairs in the graph ----------------------------------------------------------------------
def _graph_pairs(layout: TensorLayout, graph) -> None:
    """Column/row pairs of Dense and channels-last Conv layers in the model's layer graph."""
    if graph is None:
        return
    taken = {id(s.layer) for s in layout.splits}
    for column, row, dropouts in _pairs(graph, taken):
        reason = f"pair {column.operation.name} -> {row.operation.name}"
        with layout.all_or_none(reason, [column.operation, row.operation]):
            layout.splits += [
                split_layer(column.operation, COLUMN, layout.parts, reason),
                split_layer(row.operation, ROW, layout.parts, reason),
            ]
            layout.dropouts += [(d, -1) for d in dropouts]


def _note_unpaired(layout: TensorLayout, graph) -> None:
    """A line for each Dense/Conv of the graph that stays whole, saying why."""
    noted = {id(s.layer) for s in layout.splits} | {id(x) for x in layout.kept_whole}
    for node in graph.nodes if graph is not None else ():
        layer = node.operation
        if not isinstance(layer, (keras.layers.Dense, *CONVS)) or id(layer) in noted:
            continue
        why = unsplittable(layer) or (
            "no partner: its output reaches no other Dense/Conv through elementwise layers "
            "alone in this stage"
        )
        layout.replicated.append(f"{layer.name}: {why}")


def _pairs(graph, taken: set):
    """(column node, row node, Dropouts between) of each Dense/Conv pair in `graph`, in
    order; `taken` (ids of layers split otherwise) grows with each pair."""
    calls: dict = {}
    for node in graph.nodes:
        calls[id(node.operation)] = calls.get(id(node.operation), 0) + 1
    outputs = set(graph.outputs)
    for node in graph.nodes:
        if not _pairable(node.operation, calls, taken):
            continue
        found = _follow_to_row(
            graph, node, outputs, lambda x, taken=taken: _pairable(x, calls, taken, ROW)
        )
        if found is not None:
            taken |= {id(node.operation), id(found[0].operation)}
            yield node, found[0], found[1]


def pair_cuts(graph) -> set[int]:
    """Node positions of a model's `LayerGraph` where no pipeline stage should begin, because a
    Dense/Conv pair that tensor parallelism would split runs across them (a stage boundary
    there would leave both layers whole)."""
    return {
        p
        for column, row, _ in _pairs(graph, set())
        for p in range(column.position + 1, row.position + 1)
    }


def _pairable(layer, calls, taken, role: str = COLUMN) -> bool:
    return (
        isinstance(layer, (keras.layers.Dense, *CONVS))
        and id(layer) not in taken
        and calls.get(id(layer)) == 1
        and unsplittable(layer, role) is None
    )


def _follow_to_row(graph, node, outputs, is_row):
    """The row partner (the first layer `is_row` accepts) of the column layer at `node` and
    the Dropout layers on the way, or None when its output meets anything but elementwise
    layers first."""
    dropouts = []
    tensor = node.outputs[0] if len(node.outputs) == 1 else None
    while tensor is not None and tensor not in outputs:
        consumers = graph.tensors[tensor].consumers
        if len(consumers) != 1:
            return None
        nxt = graph.nodes[consumers[0]]
        layer = nxt.operation
        if len(nxt.inputs) != 1 or len(nxt.outputs) != 1:
            return None
        if is_row(layer):
            return nxt, dropouts
        if isinstance(layer, keras.layers.Dropout) and layer.noise_shape is None:
            dropouts.append(layer)
        elif not _elementwise(layer):
            return None
        tensor = nxt.outputs[0]
    return None


def _elementwise(layer) -> bool:
    """Whether `layer` acts on each feature alone, keeping features on the last axis."""
    if isinstance(layer, keras.layers.Activation):
        return getattr(layer.activation, "__name__", "") in ELEMENTWISE_ACTIVATIONS
    if isinstance(layer, (keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU)):
        return True
    if isinstance(layer, _POOLING):
        return getattr(layer, "data_format", "channels_last") == "channels_last"
    return False


# --- overrides --------------------------------------------------------------------------------
def _apply_overrides(layout: TensorLayout, layers, overrides: dict, graph) -> None:
    """Split what `overrides` names; the role follows from the layer and the split axis."""
    for layer in layers:
        own = list(_keras.own_trainable_variables(layer))
        entries = [(v, lookup(overrides, v.path)) for v in own]
        axes = {id(v): split_axis(e, v.path) for v, e in entries if e is not None}
        if not any(a is not None for a in axes.values()):
            continue
        role = _role_from_override(layer, axes)
        kernel = None if role == VOCAB else _keras.kernel_variable(layer)
        heads_axis = None if kernel is None else axes.get(id(kernel))
        split = split_layer(layer, role, layout.parts, "tensor_layout", heads_axis=heads_axis)
        for v, _ in entries:
            wanted = axes.get(id(v))
            if id(v) in axes and wanted != split.axis_of(v):
                raise ValueError(
                    f"tensor_layout splits {v.path} on axis {wanted}, but as a {role} layer "
                    f"{layer.name!r} needs it on axis {split.axis_of(v)}; drop that entry."
                )
        layout.splits.append(split)
    _override_dropouts(layout, graph)


def _role_from_override(layer, axes: dict) -> str:
    if isinstance(layer, keras.layers.Embedding):
        if axes.get(id(_keras.table_variable(layer))) == 0:
            return VOCAB
        raise ValueError(
            f"tensor_layout can split embedding {layer.name!r} only by vocabulary rows, "
            '("tensor", None).'
        )
    if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense, *CONVS)):
        raise ValueError(
            f"tensor_layout names a variable of layer {layer.name!r} ({type(layer).__name__}); "
            "hyparflow splits Dense, EinsumDense, Conv1D/2D/3D and Embedding layers."
        )
    why = unsplittable(layer)
    if why:
        raise ValueError(f"tensor_layout splits layer {layer.name!r}, but {why}.")
    kernel = _keras.kernel_variable(layer)
    axis = axes.get(id(kernel))
    rank = len(kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        inputs, kernel_letters = layer.equation.split("->")[0].split(",")
        return ROW if kernel_letters[axis] in inputs else COLUMN
    if axis == rank - 1:
        return COLUMN
    if axis == rank - 2:
        return ROW
    raise ValueError(
        f"tensor_layout splits the kernel of {layer.name!r} on axis {axis}; split its output "
        f"units (axis {rank - 1}) or its input units (axis {rank - 2})."
    )


def _override_dropouts(layout: TensorLayout, graph) -> None:
    """In a graph, each overridden column layer must reach a row layer through elementwise
    layers only; the Dropouts on the way draw full masks and keep their slice."""
    if graph is None:
        return
    rows = {id(s.layer) for s in layout.splits if s.role == ROW}
    nodes = {id(n.operation): n for n in graph.nodes}
    outputs = set(graph.outputs)
    for split in layout.splits:
        node = nodes.get(id(split.layer))
        if split.role != COLUMN or node is None:
            continue
        found = _follow_to_row(graph, node, outputs, lambda x: id(x) in rows)
        if found is None:
            raise ValueError(
                f"tensor_layout splits the output units of {split.layer.name!r}, but its output "
                "meets a layer other than an elementwise one before any layer whose input units "
                "are split; split the next Dense/Conv by its input units (its kernel axis -2)."
            )
        layout.dropouts += [(d, -1) for d in found[1]]  # found: (row node, Dropouts)


def _graph_of(model):
    try:
        return build_graph(model)
    except ValueError:
        return None


def _check_composite_dropouts(layout: TensorLayout, layers) -> None:
    """Refuse a Dropout that may draw over a split tensor without knowing its axis: inside a
    composite layer holding split layers, every Dropout must be placed by a rule, be one of
    a known block's dropouts that act on whole tensors (keras_hub's, after each pair) or lie
    inside a layer kept whole (an attention whose heads do not divide)."""
    split = {id(s.layer) for s in layout.splits}
    placed = {id(d) for d, _ in layout.dropouts}
    whole = set()  # a block's dropouts on whole tensors, and those inside layers kept whole
    for layer in layers:
        whole |= whole_tensor_dropouts(layer)
    for layer in layout.kept_whole:
        whole |= {id(x) for x in _keras.all_layers(layer, include_self=False)}
    for layer in layers:
        if isinstance(layer, (_keras.Functional, keras.Sequential)):
            continue
        inner = _keras.all_layers(layer, include_self=False)
        if not any(id(x) in split for x in inner):
            continue
        for x in inner:
            if isinstance(x, keras.layers.Dropout) and x.rate > 0 and id(x) not in placed | whole:
                raise ValueError(
                    f"Dropout {x.name!r} inside {layer.name!r} may draw over a tensor split by "
                    "tensor parallelism, and hyparflow cannot tell on which axis, so it would "
                    "train differently from Keras. Use rate 0 there, or keep the layers of "
                    f"{layer.name!r} whole (tensor_layout entries of None)."
                )
