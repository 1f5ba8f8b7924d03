"""One layer split in a Megatron role: which of its variables split on which axis."""

from __future__ import annotations

import keras

from hyparflow import _keras
from hyparflow.tensor.layout import check_divides
from hyparflow.tensor.splits import COLUMN, ROW, VOCAB, LayerSplit

# Activations that act on each element alone (softmax and glu mix the split axis).
ELEMENTWISE_ACTIVATIONS = frozenset(
    [
        "linear",
        "gelu",
        "gelu_approximate",
        "relu",
        "relu6",
        "silu",
        "swish",
        "tanh",
        "sigmoid",
        "hard_sigmoid",
        "hard_silu",
        "hard_swish",
        "elu",
        "selu",
        "softplus",
        "softsign",
        "exponential",
        "leaky_relu",
        "mish",
        "celu",
        "sparse_plus",
        "squareplus",
        "tanh_shrink",
        "hard_tanh",
        "log_sigmoid",
        "soft_shrink",
        "hard_shrink",
        "threshold",
    ]
)
CONVS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
# Regularizers and constraints that act on each element alone are exact on a shard.
_ELEMENTWISE_REGULARIZERS = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)
_ELEMENTWISE_CONSTRAINTS = (keras.constraints.NonNeg,)


def split_layer(layer, role: str, parts: int, reason: str, heads_axis: int | None = None):
    """`layer` (Dense, EinsumDense, Conv, Embedding) as a `role` layer over `parts` ranks;
    refuses a split dimension that `parts` does not divide. `heads_axis`: the kernel axis an
    EinsumDense column splits (its heads)."""
    if isinstance(layer, keras.layers.Embedding):
        check_divides(layer.name, "vocabulary rows", layer.input_dim, parts)
        table = _keras.table_variable(layer)
        axes = {id(table): (table, 0)}
        reverse = getattr(layer, "reverse_embeddings", None)
        if reverse is not None and not getattr(layer, "tie_weights", True):
            axes[id(reverse)] = (reverse, 1)
        return LayerSplit(layer, VOCAB, axes, reason)
    kernel = _keras.kernel_variable(layer)
    rank = len(kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        axis, what = (heads_axis, "heads") if role == COLUMN else (0, "heads")
    else:
        axis = rank - 1 if role == COLUMN else rank - 2
        what = "units" if isinstance(layer, keras.layers.Dense) else "channels"
    check_divides(layer.name, what, int(kernel.shape[axis]), parts)
    axes = {id(kernel): (kernel, axis)}
    bias = getattr(layer, "bias", None)
    if role == COLUMN and bias is not None:  # a row layer adds its whole bias after the sum
        bias_axis = 0
        if isinstance(layer, keras.layers.EinsumDense):
            bias_axis = einsum_bias_axis(layer, axis)
        if bias_axis is not None:
            axes[id(bias)] = (bias, bias_axis)
    return LayerSplit(layer, role, axes, reason)


def einsum_bias_axis(layer, kernel_axis: int) -> int | None:
    """The axis of an EinsumDense bias that follows kernel axis `kernel_axis` (None: the bias
    does not span it and is added whole)."""
    kernel_letters = layer.equation.split("->")[0].split(",")[1]
    letter = kernel_letters[kernel_axis]
    bias_axes = layer.bias_axes or ""
    return bias_axes.index(letter) if letter in bias_axes else None


def unsplittable(layer, role: str = COLUMN) -> str | None:
    """Why `layer` cannot be split in `role` as it is, or None (a row layer's activation comes
    after the sum, so any will do)."""
    if getattr(layer, "lora_enabled", False):
        return "LoRA is enabled"
    if getattr(layer, "quantization_mode", None):
        return "it is quantized"
    if isinstance(layer, CONVS) and (layer.groups != 1 or layer.data_format != "channels_last"):
        return "grouped or channels-first convolution"
    activation = getattr(layer, "activation", None) if role == COLUMN else None
    name = getattr(activation, "__name__", str(activation))
    if activation is not None and name not in ELEMENTWISE_ACTIVATIONS:
        return f"its activation {name!r} mixes units"
    return None


def check_elementwise(
    variable,
    split_by: str = "tensor parallelism",
    whole: str = "Keep the layer whole (tensor_layout)",
) -> None:
    """A shard's regularizer and constraint must give the whole one's values, element by
    element; others (orthogonality, norms over an axis) cannot be cut. `split_by` and `whole`
    say, in the error, what splits the variable and how to keep it whole."""
    regularizer = getattr(variable, "regularizer", None)
    if regularizer is not None and not isinstance(regularizer, _ELEMENTWISE_REGULARIZERS):
        raise ValueError(
            f"Variable {variable.path} is split by {split_by}, but its regularizer "
            f"{type(regularizer).__name__} is not elementwise (L1, L2, L1L2), so a shard cannot "
            f"compute its part. {whole} or use L1/L2."
        )
    constraint = getattr(variable, "constraint", None)
    if constraint is not None and not isinstance(constraint, _ELEMENTWISE_CONSTRAINTS):
        raise ValueError(
            f"Variable {variable.path} is split by {split_by}, but its constraint "
            f"{type(constraint).__name__} acts across elements. {whole} or drop the constraint."
        )


__all__ = ["COLUMN", "ROW", "VOCAB", "check_elementwise", "split_layer", "unsplittable"]
