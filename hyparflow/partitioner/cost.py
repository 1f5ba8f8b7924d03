"""Per-node cost estimates (layers, parameters, analytic FLOPs) and per-cut communication cost."""

from __future__ import annotations

import math

import numpy as np

from hyparflow.partitioner.graph import LayerGraph


def layer_costs(graph: LayerGraph) -> np.ndarray:
    """One unit per node: stages get equal numbers of layer calls."""
    return np.ones(len(graph.nodes))


def param_costs(graph: LayerGraph) -> np.ndarray:
    """Parameters of each layer, counted at its first call only (a shared layer's weights are
    one set; stages that reuse it store that set too, see `Stage.param_count`)."""
    costs = np.zeros(len(graph.nodes))
    seen = set()
    for node in graph.nodes:
        if node.is_layer and id(node.operation) not in seen:
            seen.add(id(node.operation))
            costs[node.position] = node.operation.count_params()
    return costs


def flop_costs(graph: LayerGraph) -> np.ndarray:
    """Estimated forward FLOPs per sample of each node (see `node_flops`)."""
    return np.array([node_flops(graph, node) for node in graph.nodes], dtype=np.float64)


def node_flops(graph: LayerGraph, node) -> float:
    """Forward FLOPs per sample of one call, from its layer type and tensor shapes.

    Multiply-adds count as 2 FLOPs. Covered: dense and convolution layers (all kinds),
    normalization, pooling, elementwise merges and activations, embeddings, recurrent layers
    and multi-head attention. Anything else costs 2 FLOPs per parameter per output position
    plus one per output element. Unknown (None) dimensions count as 1.
    """
    inputs = [_elements(graph.tensors[t].shape) for t in node.inputs]
    in_shapes = [graph.tensors[t].shape for t in node.inputs]
    out_shapes = [graph.tensors[t].shape for t in node.outputs]
    out = sum(_elements(s) for s in out_shapes)
    op = node.operation
    kind = type(op).__name__
    config = _config(op)

    if kind in ("Dense", "EinsumDense"):
        kernel = _kernel_size(op)
        positions = out / max(1, _last(out_shapes[0]))
        return 2.0 * kernel * positions + out
    if kind in _CONVOLUTIONS:
        return _convolution_flops(kind, config, in_shapes[0], inputs[0], out)
    if kind in ("BatchNormalization", "LayerNormalization", "GroupNormalization"):
        return 5.0 * out
    if kind in ("UnitNormalization", "Normalization", "RMSNormalization"):
        return 3.0 * out
    if kind.startswith(("MaxPooling", "AveragePooling")):
        return float(math.prod(config["pool_size"]) * out)
    if kind.startswith(("GlobalMaxPooling", "GlobalAveragePooling")):
        return float(inputs[0])
    if kind in ("Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum"):
        return float(out * max(1, len(inputs) - 1))
    if kind in ("LSTM", "GRU", "SimpleRNN", "ConvLSTM2D"):
        return 2.0 * _kernel_size(op) * _timesteps(in_shapes[0]) + out
    if kind == "MultiHeadAttention":
        return _attention_flops(op, in_shapes, out)
    if kind in ("Flatten", "Reshape", "InputLayer", "Dropout", "Permute", "RepeatVector"):
        return 0.0
    params = op.count_params() if node.is_layer else 0
    positions = out / max(1, _last(out_shapes[0])) if out_shapes and out_shapes[0] else 1
    return 2.0 * params * positions + out


_CONVOLUTIONS = (
    "Conv1D",
    "Conv2D",
    "Conv3D",
    "Conv1DTranspose",
    "Conv2DTranspose",
    "Conv3DTranspose",
    "DepthwiseConv1D",
    "DepthwiseConv2D",
    "SeparableConv1D",
    "SeparableConv2D",
)


def _convolution_flops(kind: str, config, in_shape, inputs: int, out: int) -> float:
    """Forward FLOPs per sample of a convolution layer of any kind (`node_flops`)."""
    window = math.prod(config["kernel_size"])
    if kind.startswith("Depthwise"):
        return 2.0 * window * out + out
    if kind.endswith("Transpose"):
        return 2.0 * window * config["filters"] * inputs + out
    if kind.startswith("Separable"):
        channels_in = _channels(in_shape, config)
        spatial = out / max(1, config["filters"])
        depth_multiplier = config.get("depth_multiplier", 1)
        depthwise = 2.0 * window * channels_in * depth_multiplier * spatial
        return depthwise + 2.0 * channels_in * depth_multiplier * out + out
    channels_in = _channels(in_shape, config) // max(1, config.get("groups", 1))
    return 2.0 * window * channels_in * out + out


def cut_costs(graph: LayerGraph, samples: int, bandwidth: float) -> np.ndarray:
    """Cost of cutting before each node position: bytes of all tensors alive across that cut
    (each is sent, with forwarding, exactly once over it) times `samples`, over `bandwidth`.

    Entry j is the cut between positions j-1 and j; entries 0 and n are zero.
    """
    return cut_bytes_per_sample(graph) * samples / bandwidth


def cut_bytes_per_sample(graph: LayerGraph) -> np.ndarray:
    """Bytes per sample alive across each cut: produced before it, read at or after it."""
    n = len(graph.nodes)
    change = np.zeros(n + 2)
    last = graph.last_use()
    for tensor in graph.tensors:
        if tensor.producer < -1 or last[tensor.index] <= tensor.producer:
            continue  # pruned, or never read
        change[tensor.producer + 1] += tensor.bytes_per_sample
        change[last[tensor.index] + 1] -= tensor.bytes_per_sample
    alive = np.cumsum(change)[: n + 1]
    alive[0] = alive[n] = 0.0
    return alive


def _elements(shape) -> int:
    return math.prod(1 if d is None else int(d) for d in shape)


def _last(shape) -> int:
    return 1 if not shape or shape[-1] is None else int(shape[-1])


def _config(op) -> dict:
    try:
        return op.get_config()
    except Exception:  # an Operation or custom layer without a config: use the fallback
        return {}


def _kernel_size(op) -> int:
    """Elements of the layer's kernel-like (non-bias) trainable weights."""
    total = 0
    for weight in getattr(op, "trainable_weights", []):
        if len(weight.shape) >= 2:
            total += math.prod(weight.shape)
    return total


def _channels(shape, config) -> int:
    if config.get("data_format") == "channels_first":
        return 1 if shape[0] is None else int(shape[0])
    return _last(shape)


def _timesteps(shape) -> int:
    return 1 if len(shape) < 2 or shape[0] is None else int(shape[0])


def _attention_flops(op, in_shapes, out) -> float:
    query_len = _timesteps(in_shapes[0])
    key_len = _timesteps(in_shapes[1]) if len(in_shapes) > 1 else query_len
    config = _config(op)
    heads, key_dim = config.get("num_heads", 1), config.get("key_dim", 1)
    value_dim = config.get("value_dim") or key_dim
    projections = 2.0 * _kernel_size(op) * max(query_len, key_len)
    attention = 2.0 * heads * query_len * key_len * (key_dim + value_dim)
    return projections + attention + out
