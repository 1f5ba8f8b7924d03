"""Stage sub-models for a contiguous split: boundary tensors, forwarding, shared layer objects."""

from __future__ import annotations

import warnings

import keras

# Keras's graph node. Stage graphs are made of new nodes that call the user's own layer
# objects on new symbolic tensors: exactly what Keras does when a layer is reused, without
# re-running shape inference (which would cost seconds on a 5,000-layer model).
from hyparflow import _keras
from hyparflow.partitioner.graph import LayerGraph, safe_name
from hyparflow.partitioner.plan import BoundaryTensor, Stage


def build_stages(
    graph: LayerGraph, starts: list[int], node_costs, cut_costs=None
) -> tuple[list[Stage], dict[str, list[int]]]:
    """One `Stage` per contiguous range of node positions beginning at each of `starts`, and
    the layers shared by several stages (name -> stage indices).

    The stages form a linear chain. Every tensor still needed after a stage (read by a later
    stage, or a model output) is in that stage's `sends`: computed there, or received and
    forwarded unchanged. Stage 0 receives the model inputs; the last stage sends exactly the
    model outputs, in order.
    """
    chain = _Chain(graph, starts)
    owner = _owner_stages(graph, chain.stage_of)
    shared = _shared_layers(graph, chain.stage_of)
    stages = []
    receives_ids, receives = list(graph.inputs), chain.model_inputs()
    for k in range(len(starts)):
        first, end = chain.bounds[k], chain.bounds[k + 1]
        nodes = graph.nodes[first:end]
        send_ids, sends = chain.sends(k, nodes, receives_ids)
        # here, not in _Chain: the warning's stacklevel names build_stages's caller
        _warn_about_masks(graph, send_ids if k < chain.last else [])
        model = stage_model(graph, k, nodes, receives_ids, send_ids)
        layer_objects = {}
        for node in nodes:
            if node.is_layer:
                layer_objects.setdefault(node.layer_name, node.operation)
        comm_cost = 0.0
        if cut_costs is not None:
            comm_cost = float(cut_costs[first] + cut_costs[end])
        stages.append(
            Stage(
                index=k,
                model=model,
                layers=list(layer_objects),
                ops=list(dict.fromkeys(node.layer_name for node in nodes if not node.is_layer)),
                nodes=[node.name for node in nodes],
                receives=receives,
                sends=sends,
                cost=float(sum(node_costs[first:end])) + comm_cost,
                comm_cost=comm_cost,
                param_count=sum(layer.count_params() for layer in layer_objects.values()),
                owned_layers=[name for name in layer_objects if owner[name] == k],
                layer_objects=layer_objects,
            )
        )
        receives_ids, receives = send_ids, sends
    return stages, shared


class _Chain:
    """Which stage computes each tensor of a linear split, which stages read it, and what each
    stage therefore receives and sends."""

    def __init__(self, graph: LayerGraph, starts: list[int]):
        n = len(graph.nodes)
        self.graph = graph
        self.bounds = [*starts, n]
        self.last = len(starts) - 1
        self.stage_of = [0] * n
        for k in range(len(starts)):
            for position in range(self.bounds[k], self.bounds[k + 1]):
                self.stage_of[position] = k
        self.readers = [sorted({self.stage_of[c] for c in t.consumers}) for t in graph.tensors]
        self.outputs = set(graph.outputs)
        self.source = [self.stage_of[t.producer] if t.producer >= 0 else -1 for t in graph.tensors]

    def model_inputs(self) -> list[BoundaryTensor]:
        """What stage 0 receives: the model's inputs."""
        return [
            BoundaryTensor(
                name=self.graph.tensors[t].name,
                shape=self.graph.tensors[t].shape,
                dtype=self.graph.tensors[t].dtype,
                source_stage=-1,
                dest_stage=-1 if t in self.outputs else (self.readers[t] or [0])[-1],
                consumer_stages=tuple(self.readers[t]),
            )
            for t in self.graph.inputs
        ]

    def sends(self, k: int, nodes, receives_ids) -> tuple[list[int], list[BoundaryTensor]]:
        """Stage `k`'s sent tensor ids and boundaries: the model outputs from the last stage,
        else every received or computed tensor still needed after it."""
        if k == self.last:
            send_ids = list(self.graph.outputs)
            return send_ids, _unique_names([self._boundary(t, k) for t in send_ids])
        produced = [t for node in nodes for t in node.outputs]
        send_ids = [t for t in receives_ids + produced if self._needed_after(t, k)]
        return send_ids, [self._boundary(t, k) for t in send_ids]

    def _needed_after(self, t: int, k: int) -> bool:
        return t in self.outputs or (self.readers[t] and self.readers[t][-1] > k)

    def _boundary(self, t: int, k: int) -> BoundaryTensor:
        tensor = self.graph.tensors[t]
        return BoundaryTensor(
            name=tensor.name,
            shape=tensor.shape,
            dtype=tensor.dtype,
            source_stage=self.source[t],
            dest_stage=-1 if t in self.outputs else self.readers[t][-1],
            forwarded=self.source[t] != k,
            consumer_stages=tuple(self.readers[t]),
        )


def stage_model(graph: LayerGraph, k: int, nodes, receives_ids, send_ids):
    """A `keras.Model` from the received tensors to the sent ones, calling the user's layers.

    Stage 0 takes the user's own `model.inputs`; later stages take new `keras.Input`s of the
    received shapes. A forwarded tensor is an input returned as an output unchanged.
    """
    if k == 0:
        inputs = list(graph.root.inputs)
    else:
        inputs = [
            keras.Input(
                batch_shape=graph.tensors[t].keras_tensor.shape,
                dtype=graph.tensors[t].keras_tensor.dtype,
                sparse=graph.tensors[t].keras_tensor.sparse,
                name=f"stage{k}_in{i}_{safe_name(graph.tensors[t].name)}",
            )
            for i, t in enumerate(receives_ids)
        ]
    symbolic = dict(zip(receives_ids, inputs, strict=True))
    for node in nodes:
        lookup = {kt_id: symbolic[t] for kt_id, t in node.argument_tensors.items()}
        args, kwargs = node.arguments.fill_in(lookup)
        outputs = [_like(graph.tensors[t].keras_tensor) for t in node.outputs]
        _keras.Node(node.operation, call_args=args, call_kwargs=kwargs, outputs=outputs)
        symbolic.update(zip(node.outputs, outputs, strict=True))
    name = f"{safe_name(graph.model.name)}_stage{k}"
    return keras.Model(inputs=inputs, outputs=[symbolic[t] for t in send_ids], name=name)


def _like(keras_tensor):
    """A new symbolic tensor with the shape and dtype of `keras_tensor`."""
    return keras.KerasTensor(
        shape=keras_tensor.shape,
        dtype=keras_tensor.dtype,
        sparse=keras_tensor.sparse,
        ragged=getattr(keras_tensor, "ragged", False),
    )


def _owner_stages(graph, stage_of) -> dict[str, int]:
    """The first stage calling each layer: it owns the layer's regularization losses."""
    owner = {}
    for node in graph.nodes:
        if node.is_layer:
            owner.setdefault(node.layer_name, stage_of[node.position])
    return owner


def _shared_layers(graph, stage_of) -> dict[str, list[int]]:
    """Layers called from more than one stage, with those stages."""
    stages_of_layer = {}
    for node in graph.nodes:
        if node.is_layer:
            stages_of_layer.setdefault(node.layer_name, set()).add(stage_of[node.position])
    return {name: sorted(s) for name, s in stages_of_layer.items() if len(s) > 1}


def _unique_names(boundaries):
    """Model outputs may repeat a tensor; give repeats distinct names."""
    seen = {}
    result = []
    for b in boundaries:
        count = seen.get(b.name, 0)
        seen[b.name] = count + 1
        if count:
            b = BoundaryTensor(**{**b.__dict__, "name": f"{b.name}~{count}"})
        result.append(b)
    return result


def _warn_about_masks(graph, tensor_ids):
    masked = [
        graph.tensors[t].name
        for t in tensor_ids
        if _keras.keras_mask(graph.tensors[t].keras_tensor) is not None
    ]
    if masked:
        warnings.warn(
            f"Tensors {masked} carry a Keras mask, which does not cross stage boundaries; "
            "keep the masking layer and its consumers in one stage (explicit balance list).",
            stacklevel=3,
        )
