"""A model's costs as one of T tensor ranks pays them: split work and weights, summed activations.

Under Megatron-style tensor parallelism (docs/tensor.md) every rank of a group of T runs the
whole micro-batch through every layer, but a split layer holds 1/T of its weights and does
1/T of their work, while each row layer's output (forward) and each column layer's input
gradient (backward) is summed over the T ranks: an allreduce of whole activations inside the
step, priced by the alpha-beta model plus the host round trip an in-graph collective costs
(`EngineCosts.collective_call`). `tensor_costs` turns measured `ModelCosts` (whose layers carry
their `TensorShare`) into those of one rank of the group, which `predict` then treats as a
rank of P x R. Compute is taken to split with the parameters: attention scores split by heads
like their projections; elementwise layers between a pair are counted whole (a small excess).
Pure Python.
"""

from __future__ import annotations

from dataclasses import replace

from hyparflow.simulate.costs import Affine, LayerCost, ModelCosts, TensorShare
from hyparflow.simulate.network import Network, allreduce

DEFAULT_BATCHES = (16, 64)  # where the exchanges' lines are drawn, if costs name no batches


def tensor_costs(costs: ModelCosts, tensor: int, network: Network, crosses_nodes=False):
    """`costs` as one of `tensor` ranks pays them (`costs` itself for one). Raises ValueError
    when the costs were measured without their tensor shares."""
    if tensor == 1:
        return costs
    if not costs.measured.get("tensor_parts"):
        raise ValueError(
            "the costs hold no tensor shares (measured before they were): time the model "
            "again to price tensor parallelism"
        )
    link = network.link(crosses_nodes)
    batches = tuple(costs.measured.get("batch_sizes") or DEFAULT_BATCHES)

    def exchanged(nbytes: float, calls: int) -> Affine:
        """`calls` allreduces of `nbytes` per sample in all, as a line in the batch."""
        if not calls:
            return Affine()

        def seconds(batch):
            each = allreduce(nbytes * batch / calls, tensor, link, network.reduce_rate)[0]
            return calls * (each + costs.engine.collective_call)

        low, high = batches
        return Affine.through(low, seconds(low), high, seconds(high))

    # each layer's exchanges, forward and backward, priced once for its passes and the step's
    exchanges = [
        (exchanged(s.forward_bytes, s.forward_calls), exchanged(s.backward_bytes, s.backward_calls))
        for s in (layer.tensor for layer in costs.layers)
    ]
    layers = [
        _split_layer(layer, tensor, *pair)
        for layer, pair in zip(costs.layers, exchanges, strict=True)
    ]
    split = replace(costs, layers=layers, single_process=None)
    if costs.fused is not None:  # the one-call step: its per-sample work splits as its layers'
        kept = _kept_work(costs.layers, tensor)
        fused = Affine(costs.fused.fixed, costs.fused.per_sample * kept)
        split.fused = sum((f + b for f, b in exchanges), fused)
    return split


def _kept_work(layers: list[LayerCost], tensor: int) -> float:
    """The fraction of the layers' per-sample work one of `tensor` ranks keeps: a ratio of the
    layers' measured slopes, steadier than their difference from the whole step's."""
    work = [layer.forward.per_sample + layer.backward.per_sample for layer in layers]
    if not sum(work):
        return 1.0
    split = sum(w * layer.tensor.split_fraction for w, layer in zip(work, layers, strict=True))
    return 1 - split / sum(work) * (1 - 1 / tensor)


def _split_layer(
    layer: LayerCost, tensor: int, summed_forward: Affine, summed_backward: Affine
) -> LayerCost:
    """`layer` on one of `tensor` ranks, paying its exchanges' `summed_forward` and
    `summed_backward` seconds."""
    share: TensorShare = layer.tensor
    kept = 1 - share.split_fraction * (1 - 1 / tensor)  # of the layer's per-sample work
    forward = _kept(layer.forward, kept) + summed_forward
    backward = _kept(layer.backward, kept) + summed_backward
    param_bytes = layer.param_bytes - int(share.split_bytes * (1 - 1 / tensor))
    return replace(layer, forward=forward, backward=backward, param_bytes=param_bytes)


def _kept(line: Affine, fraction: float) -> Affine:
    return Affine(line.fixed, line.per_sample * fraction)
