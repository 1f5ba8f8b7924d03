"""Global-batch dropout masks for models run one slice of the batch at a time.

Keras draws a dropout mask of the shape of the tensor it is given, so when a
global batch of B rows runs as micro-batches spread over replicas, every piece
would get its own unrelated mask and training would drift from single-process
Keras. Inside `global_batch_slice(offset, global_size)`, Keras's TensorFlow
dropout draws, from the same seed and exactly once per call, the mask Keras
would draw for the whole (global_size, ...) batch, and applies its rows
[offset, offset + n) to a piece of n rows; the dropout's outputs on the pieces
then put together equal its full-batch output bit for bit, gradients included
(layers around it, such as a matmul over fewer rows, may round differently).
Stochastic depth (keras_hub's `DropPath` in Swin and MiT) draws one uniform
number per sample, `keras.random.uniform((batch, 1, ..., 1))`; inside a slice
it draws the global batch's numbers and keeps the piece's rows the same way.
Random layers whose draws cannot be cut into rows are named by
`unsliceable_random_layers`.
"""

import contextlib
import numbers
import threading

import keras
import tensorflow as tf
from keras.layers import Attention, Dropout
from keras.random import SeedGenerator

from hyparflow import _keras
from hyparflow.intercept import Replaced

__all__ = ["feature_slice", "global_batch_slice", "slice_of", "unsliceable_random_layers"]

# Layers whose only own randomness is `backend.random.dropout` on a tensor
# whose axis 0 is the batch: Dropout and SpatialDropout1D/2D/3D, Attention and
# AdditiveAttention (scores of shape (batch, Tq, Tv)), and the LSTM, GRU,
# SimpleRNN and ConvLSTM cells (masks of shape (batch, features)).
# MultiHeadAttention and GroupedQueryAttention draw through a Dropout sub-layer
# and own no SeedGenerator, so they need no entry.
SLICEABLE_RANDOM_LAYER_TYPES = (Dropout, Attention, _keras.DropoutRNNCell)
# Layers (by class, module-qualified: keras_hub is optional) whose only draw is
# `keras.random.uniform` of shape (batch, 1, ..., 1) from their own SeedGenerator:
# one number per sample of the tensor they are given.
PER_SAMPLE_UNIFORM_LAYERS = frozenset(
    {
        "keras_hub.src.models.swin_transformer.swin_transformer_layers.DropPath",
        "keras_hub.src.models.mit.mit_layers.DropPath",
    }
)

_install_lock = threading.Lock()
_keras_functions = {}  # Keras's dropout and uniform, as found when the slicing ones went in
_thread_state = threading.local()


def _active_slices():
    """This thread's stack of (offset, global_size) pairs, innermost last."""
    if not hasattr(_thread_state, "slices"):
        _thread_state.slices = []
    return _thread_state.slices


def _active_features():
    """This thread's stack of (axis, index, parts) feature slices, innermost last."""
    if not hasattr(_thread_state, "features"):
        _thread_state.features = []
    return _thread_state.features


@contextlib.contextmanager
def global_batch_slice(offset, global_size):
    """Make Keras dropout treat its input as rows [offset, offset + n) of a global batch.

    `offset` and `global_size` are Python ints or scalar integer tensors. Inside
    a `tf.function`, enter the context in the traced body with tensors passed
    as the function's arguments, so that one trace serves every piece: Python
    ints and captured eager tensors are baked into the trace. Contexts nest (the
    innermost applies) and are per thread; Keras's function is put back when
    the last one exits.
    """
    if isinstance(offset, numbers.Integral) and offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if isinstance(global_size, numbers.Integral) and global_size < 1:
        raise ValueError(f"global_size must be >= 1, got {global_size}")
    with _pushed(_active_slices(), (offset, global_size)):
        yield


@contextlib.contextmanager
def feature_slice(axis: int, index: int, parts: int):
    """Make Keras dropout treat its input as piece `index` of `parts` equal pieces of a whole
    tensor along `axis` (a tensor-parallel shard): it draws the whole tensor's mask from the
    same seed and keeps its piece. Combines with `global_batch_slice`."""
    with _pushed(_active_features(), (axis, index, parts)):
        yield


@contextlib.contextmanager
def _pushed(stack, entry):
    """Install the slicing dropout and uniform while `entry` is on this thread's `stack`."""
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError("sliced dropout needs the TensorFlow backend of Keras")
    with _install_lock:  # one installation for every thread's slices (`intercept.py`)
        _SLICING.__enter__()
    stack.append(entry)
    try:
        yield
    finally:
        stack.pop()
        with _install_lock:
            _SLICING.__exit__(None, None, None)


def slice_of(rows):
    """`global_batch_slice(offset, global_size)` for `rows` = [offset, global_size] (a tensor
    or pair), or no context for None (the input is the whole batch)."""
    if rows is None:
        return contextlib.nullcontext()
    return global_batch_slice(rows[0], rows[1])


def _dropout_in_slice(inputs, rate, noise_shape=None, seed=None):
    """Keras's TF dropout, cut to this piece's rows of the global mask while a slice is active."""
    slices, features = _active_slices(), _active_features()
    # Rates 0 and 1 draw nothing and act row by row, so Keras's shortcuts apply.
    trivial_rate = isinstance(rate, numbers.Real) and rate in (0.0, 1.0)
    if not (slices or features) or trivial_rate:
        return _keras_functions["dropout"](inputs, rate, noise_shape=noise_shape, seed=seed)
    offset, global_size = slices[-1] if slices else (0, None)
    feature = features[-1] if features else None
    return _dropout_rows(inputs, rate, noise_shape, seed, offset, global_size, feature)


def _uniform_in_slice(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
    """Keras's TF uniform; drawn by a per-sample layer inside a batch slice, this piece's rows
    of the numbers the global batch would draw from the same seed."""
    slices = _active_slices()
    if not slices or not _draws_per_sample(_keras.calling_layer()):
        return _keras_functions["uniform"](shape, minval, maxval, dtype=dtype, seed=seed)
    offset, global_size = slices[-1]
    shape = list(shape)
    whole = _keras_functions["uniform"](
        [_as_int32(global_size), *shape[1:]], minval, maxval, dtype, seed
    )
    begin = [_as_int32(offset)] + [0] * (len(shape) - 1)
    return tf.slice(whole, begin, [_as_int32(shape[0])] + [-1] * (len(shape) - 1))


def _draws_per_sample(layer) -> bool:
    kind = type(layer)
    return f"{kind.__module__}.{kind.__qualname__}" in PER_SAMPLE_UNIFORM_LAYERS


def _dropout_rows(inputs, rate, noise_shape, seed, offset, global_size, feature=None):
    """Apply rows [offset, offset + n) of the global batch's dropout mask to `inputs` (of
    this rank's piece of the features, when `feature` = (axis, index, parts))."""
    inputs = tf.convert_to_tensor(inputs)
    if inputs.shape.rank is None or inputs.shape.rank == 0:
        raise ValueError(
            f"dropout inside global_batch_slice needs a batch axis, got shape {inputs.shape}"
        )
    if global_size is None:
        global_size = _dim(inputs, 0)
    mask_shape, batch_is_shared = _global_mask_shape(inputs, noise_shape, global_size)
    begin = [0] * inputs.shape.rank
    size = [-1] * inputs.shape.rank
    if feature is not None:
        axis, index, parts = feature
        if noise_shape is not None:
            raise ValueError("a tensor-parallel Dropout slices only full-shape masks")
        axis %= inputs.shape.rank
        piece = _dim(inputs, axis)
        mask_shape[axis] = piece * parts
        begin[axis], size[axis] = piece * index, piece

    # Let Keras draw the seed (once, advancing its SeedGenerator as usual) and
    # the uniform noise of the full batch's mask shape: dropping out ones leaves
    # exactly the kept positions non-zero, since the scale 1 / (1 - rate) is.
    dropped_ones = _keras_functions["dropout"](
        tf.ones(mask_shape, dtype=inputs.dtype), rate, seed=seed
    )
    keep = tf.not_equal(dropped_ones, tf.zeros([], dtype=inputs.dtype))
    if not batch_is_shared:
        begin[0], size[0] = _as_int32(offset), _dim(inputs, 0)
    if not batch_is_shared or feature is not None:
        keep = tf.slice(keep, [_as_int32(b) for b in begin], [_as_int32(n) for n in size])

    # Same ops as TF's dropout on the full batch, so kept values match bitwise
    # and the gradient to `inputs` only keeps this piece's rows of the mask.
    outputs = tf.where(keep, _scale_like_tf(inputs, rate), tf.zeros([], dtype=inputs.dtype))
    if not tf.executing_eagerly():
        outputs.set_shape(inputs.shape)
    return outputs


def _scale_like_tf(inputs, rate):
    """Scale kept values the way `tensorflow/python/ops/nn_ops.py::_dropout` does."""
    if isinstance(rate, numbers.Real):
        return inputs * tf.convert_to_tensor(1 / (1 - rate), dtype=inputs.dtype)
    rate = tf.cast(rate, inputs.dtype)
    return tf.realdiv(inputs, tf.subtract(tf.constant(1, dtype=inputs.dtype), rate))


def _global_mask_shape(inputs, noise_shape, global_size):
    """Return the noise shape Keras would use on the full batch, and whether its batch dim is 1."""
    rank = inputs.shape.rank
    if noise_shape is None:
        return [_as_int32(global_size)] + [_dim(inputs, i) for i in range(1, rank)], False
    if tf.is_tensor(noise_shape):
        noise_shape = tf.unstack(noise_shape, num=rank)
    noise_shape = list(noise_shape)
    # As in Keras, None means "this dim of the input"; the input's batch dim
    # stands for the global batch.
    trailing = [
        _dim(inputs, i) if value is None else _as_int32(value)
        for i, value in enumerate(noise_shape[1:], start=1)
    ]
    if _batch_dim_is_shared(inputs, noise_shape[0]):
        return [1] + trailing, True
    return [_as_int32(global_size)] + trailing, False


def _batch_dim_is_shared(inputs, batch_noise_dim):
    """Whether a noise shape's batch dim means one mask for all rows rather than one per row."""
    if batch_noise_dim is None:
        return False
    value = (
        tf.get_static_value(batch_noise_dim) if tf.is_tensor(batch_noise_dim) else batch_noise_dim
    )
    if value is None or int(value) != 1:
        return False
    if inputs.shape[0] != 1:
        return True
    # For a one-row piece, a 1 is either a shared dim or the piece's own batch
    # size read from its shape, as SpatialDropout layers do; they are the only
    # Keras callers of the second kind.
    return not _keras.called_by_spatial_dropout()


def _dim(tensor, axis):
    """The static size of `axis` when known, else the dynamic one."""
    static = tensor.shape[axis]
    return static if static is not None else tf.shape(tensor)[axis]


def _as_int32(value):
    """Keep Python ints static; cast integer tensors to int32 so shape lists pack."""
    if isinstance(value, numbers.Integral):
        return int(value)
    return tf.cast(value, tf.int32)


def unsliceable_random_layers(model, extra_sliceable_types=()):
    """Names of the layers in `model`, nested ones included, that `global_batch_slice` cannot slice.

    `global_batch_slice` only reaches Keras's dropout, and only a draw whose
    shape is the input's, batch first, can be cut into rows. GaussianNoise,
    GaussianDropout and AlphaDropout draw with Keras's other random functions
    (normal, uniform), and the random preprocessing and augmentation layers
    (RandomFlip, RandomRotation, RandomZoom, RandomCrop, RandomContrast, ...)
    draw per-image or per-batch parameters with shapes other than the input's.
    All of them size their draws from the batch they are given, so a piece of
    the batch would get other numbers than its rows of a full-batch draw, and a
    sliced run could not match single-process Keras.

    The rule is general rather than a list of names: a layer is listed when it
    owns a `keras.random.SeedGenerator` (tracked in `layer._seed_generators` or
    held in an attribute) and is not one of SLICEABLE_RANDOM_LAYER_TYPES or of
    `extra_sliceable_types` (for custom layers known to draw only dropout of
    batch-first tensors). Layers such as MultiHeadAttention, whose randomness
    is only in Dropout sub-layers, own no generator and are not listed. Draws
    from Keras's global SeedGenerator (random ops called with seed=None) belong
    to no layer and cannot be seen here.
    """
    sliceable = SLICEABLE_RANDOM_LAYER_TYPES + tuple(extra_sliceable_types)
    return [
        layer.name
        for layer in _keras.all_layers(model)
        if _owns_seed_generator(layer)
        and not isinstance(layer, sliceable)
        and not _draws_per_sample(layer)
        and not _draws_nothing(layer)
    ]


# The attributes random layers keep their probability in: Keras's `rate`, keras_hub's
# stochastic depth `drop_prob` (Swin; MiT's says `rate`).
_RATE_ATTRIBUTES = ("rate", "drop_prob")


def _draws_nothing(layer) -> bool:
    """Whether `layer`'s rate is 0, so that it returns its input without drawing (keras_hub's
    stochastic depth below its deepest block, a Dropout(0.0))."""
    rates = [getattr(layer, name) for name in _RATE_ATTRIBUTES if hasattr(layer, name)]
    return bool(rates) and all(isinstance(r, numbers.Real) and r == 0 for r in rates)


def _owns_seed_generator(layer):
    """Whether `layer` itself (not a sub-layer) holds a SeedGenerator."""
    if _keras.seed_generators(layer):
        return True
    # Generators can also sit in untracked attributes, or in lists and dicts
    # (data layers keep one per backend in a dict).
    for value in vars(layer).values():
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, (list, tuple)):
            if any(isinstance(item, SeedGenerator) for item in value):
                return True
        elif isinstance(value, SeedGenerator):
            return True
    return False


def _slicing(name: str, replacement):
    """The `make` that puts `replacement` in place of Keras's `name`, kept to draw with."""

    def make(previous):
        _keras_functions[name] = previous
        return replacement

    return make


_SLICING = Replaced(
    [
        (_keras.tf_random, "dropout", _slicing("dropout", _dropout_in_slice)),
        (_keras.tf_random, "uniform", _slicing("uniform", _uniform_in_slice)),
    ]
)
