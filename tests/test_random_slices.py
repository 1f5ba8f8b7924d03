"""Dropout run on slices of a global batch under global_batch_slice equals one full-batch call.

Each case draws Keras's full-batch output once, then replays the same seed state for every
piece of the batch (as the engine does for every micro-batch of a step) and requires the
pieces put together to drop the same units, eagerly and inside one tf.function trace.

Where a case is elementwise (dropout alone: each output is its input times the same scale, or
zero), the pieces must equal the full batch bit for bit, by construction. Where a matmul stands
around the dropout (attention, a Dense between two dropouts), a matmul over 8 rows and one over
3+1+4 rows need not round alike (CPU kernels block by row count and instruction set): there the
dropped units must match exactly and the values within float32 rounding, while a different mask
would move them by O(1).
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src.backend.tensorflow import random as keras_tf_random

from hyparflow.engine.keras_semantics.random_slices import (
    global_batch_slice,
    unsliceable_random_layers,
)

GLOBAL_SIZE = 8
SPLITS = {
    "3+5": [(0, 3), (3, 8)],
    # A one-row piece away from offset 0: its noise shape's batch dim of 1 is ambiguous.
    "3+1+4": [(0, 3), (3, 4), (4, 8)],
}
KERAS_DROPOUT = keras_tf_random.dropout
# float32 rounding of the matmuls around a dropout, far below a changed mask's O(1) effect
MATMUL_RTOL, MATMUL_ATOL = 1e-5, 1e-6


def _call(layer, rows):
    return layer(rows, training=True)


def _call_attention(layer, rows):
    return layer(rows, rows, training=True)


def _two_dropout_sequential():
    return keras.Sequential(
        [
            keras.layers.Dropout(0.3, seed=7),
            keras.layers.Dense(6),
            keras.layers.Dropout(0.5, seed=8),
        ]
    )


# name: (layer factory, global input shape, how to call the layer on some rows)
CASES = {
    "dropout_0.1": (lambda: keras.layers.Dropout(0.1, seed=1), (8, 6), _call),
    "dropout_0.5": (lambda: keras.layers.Dropout(0.5, seed=2), (8, 6), _call),
    "spatial_1d": (lambda: keras.layers.SpatialDropout1D(0.5, seed=3), (8, 5, 4), _call),
    "spatial_2d": (lambda: keras.layers.SpatialDropout2D(0.5, seed=4), (8, 3, 3, 4), _call),
    "noise_shape_per_row": (
        lambda: keras.layers.Dropout(0.5, noise_shape=(None, 1, 4), seed=5),
        (8, 5, 4),
        _call,
    ),
    "noise_shape_shared_batch": (
        lambda: keras.layers.Dropout(0.5, noise_shape=(1, None), seed=6),
        (8, 6),
        _call,
    ),
    "multi_head_attention": (
        lambda: keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, dropout=0.3, seed=9),
        (8, 4, 6),
        _call_attention,
    ),
    "sequential_two_dropouts": (_two_dropout_sequential, (8, 6), _call),
    # stochastic depth: one keras.random.uniform number per sample
    "swin_drop_path": (
        lambda: _hub_layer("swin_transformer.swin_transformer_layers", drop_prob=0.5, seed=10),
        (8, 3, 3, 4),
        _call,
    ),
    "mit_drop_path": (lambda: _hub_layer("mit.mit_layers", rate=0.5, seed=11), (8, 5, 4), _call),
}


def _hub_layer(module: str, **options):
    """keras_hub's `DropPath` of `module` (keras_hub is installed apart: Makefile)."""
    import importlib

    return importlib.import_module(f"keras_hub.src.models.{module}").DropPath(**options)


# cases whose outputs pass through a matmul (not bitwise across batch splits)
WITH_MATMUL = {"multi_head_attention", "sequential_two_dropouts"}


def _assert_same_draws(name, pieces, full):
    """The pieces, put together, dropped what the full batch dropped (see the module doc)."""
    together = np.concatenate(pieces)
    np.testing.assert_array_equal(together == 0, full == 0)
    if name in WITH_MATMUL:
        np.testing.assert_allclose(together, full, rtol=MATMUL_RTOL, atol=MATMUL_ATOL)
    else:
        np.testing.assert_array_equal(together, full)


def _seed_states(layer):
    """The state variables of every SeedGenerator in `layer` and its sub-layers."""
    return [
        generator.state for sub in layer._flatten_layers() for generator in sub._seed_generators
    ]


def _snapshot(states):
    return [state.numpy() for state in states]


def _restore(states, values):
    for state, value in zip(states, values, strict=True):
        state.assign(value)


def _make_case(name):
    """A built layer of the case, its global batch and its call function."""
    factory, shape, call = CASES[name]
    keras.utils.set_random_seed(1234)
    layer = factory()
    x = tf.constant(np.random.default_rng(0).normal(size=shape).astype("float32"))
    layer_or_call = call(layer, x[:1])  # builds the layer (and MHA's Dropout) first
    del layer_or_call
    return layer, x, call


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", CASES)
def test_eager_pieces_equal_full_batch(name, split):
    layer, x, call = _make_case(name)
    states = _seed_states(layer)
    assert states, "the case must hold a SeedGenerator"
    start_state = _snapshot(states)
    full = call(layer, x).numpy()
    state_after_full = _snapshot(states)

    pieces = []
    for begin, end in SPLITS[split]:
        _restore(states, start_state)
        with global_batch_slice(begin, GLOBAL_SIZE):
            pieces.append(call(layer, x[begin:end]).numpy())
        # The seed is drawn once per dropout call, as in Keras's full-batch call.
        np.testing.assert_array_equal(_snapshot(states), state_after_full)

    _assert_same_draws(name, pieces, full)
    assert keras_tf_random.dropout is KERAS_DROPOUT


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", CASES)
def test_traced_pieces_equal_full_batch_with_one_trace(name, split):
    layer, x, call = _make_case(name)
    states = _seed_states(layer)
    start_state = _snapshot(states)
    rows_spec = tf.TensorSpec([None, *x.shape[1:]], x.dtype)
    int_spec = tf.TensorSpec([], tf.int32)

    @tf.function(input_signature=[rows_spec])
    def full_batch(rows):
        return call(layer, rows)

    traces = []

    @tf.function(input_signature=[rows_spec, int_spec, int_spec])
    def piece(rows, offset, global_size):
        traces.append(1)
        with global_batch_slice(offset, global_size):
            return call(layer, rows)

    full = full_batch(x).numpy()
    pieces = []
    for begin, end in SPLITS[split]:
        _restore(states, start_state)
        pieces.append(piece(x[begin:end], tf.constant(begin), tf.constant(GLOBAL_SIZE)).numpy())

    assert len(traces) == 1
    _assert_same_draws(name, pieces, full)
    assert keras_tf_random.dropout is KERAS_DROPOUT


@pytest.mark.parametrize(
    "name", ["dropout_0.5", "spatial_1d", "spatial_2d", "noise_shape_shared_batch"]
)
def test_one_row_pieces_traced_with_static_shape(name):
    layer, x, call = _make_case(name)
    states = _seed_states(layer)
    start_state = _snapshot(states)
    full = call(layer, x).numpy()
    traces = []

    @tf.function(
        input_signature=[
            tf.TensorSpec([1, *x.shape[1:]], x.dtype),
            tf.TensorSpec([], tf.int32),
            tf.TensorSpec([], tf.int32),
        ]
    )
    def piece(rows, offset, global_size):
        traces.append(1)
        with global_batch_slice(offset, global_size):
            return call(layer, rows)

    pieces = []
    for begin in range(GLOBAL_SIZE):
        _restore(states, start_state)
        pieces.append(piece(x[begin : begin + 1], tf.constant(begin), tf.constant(GLOBAL_SIZE)))

    assert len(traces) == 1
    _assert_same_draws(name, pieces, full)


@pytest.mark.parametrize("name", ["dropout_0.5", "spatial_1d", "noise_shape_shared_batch"])
def test_gradient_of_pieces_equals_rows_of_full_batch_gradient(name):
    layer, x, call = _make_case(name)
    states = _seed_states(layer)
    start_state = _snapshot(states)
    output_weights = tf.constant(np.random.default_rng(1).normal(size=x.shape).astype("float32"))

    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(call(layer, x) * output_weights)
    full_gradient = tape.gradient(loss, x).numpy()

    piece_gradients = []
    for begin, end in SPLITS["3+5"]:
        _restore(states, start_state)
        rows = x[begin:end]
        with tf.GradientTape() as tape, global_batch_slice(begin, GLOBAL_SIZE):
            tape.watch(rows)
            loss = tf.reduce_sum(call(layer, rows) * output_weights[begin:end])
        piece_gradients.append(tape.gradient(loss, rows).numpy())

    assert np.array_equal(np.concatenate(piece_gradients), full_gradient)
    assert np.count_nonzero(full_gradient == 0) > 0, "dropout should zero some gradients"


def test_tensor_rate_and_integer_seed():
    x = tf.constant(np.random.default_rng(2).normal(size=(8, 5)).astype("float32"))
    rate = tf.constant(0.4)
    full = keras.random.dropout(x, rate, seed=11).numpy()
    pieces = []
    for begin, end in SPLITS["3+5"]:
        with global_batch_slice(tf.constant(begin, tf.int64), tf.constant(GLOBAL_SIZE, tf.int64)):
            pieces.append(keras.random.dropout(x[begin:end], rate, seed=11).numpy())
    assert np.array_equal(np.concatenate(pieces), full)


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_trivial_rates_keep_keras_behaviour(rate):
    x = tf.ones((8, 3))
    with global_batch_slice(3, GLOBAL_SIZE):
        piece = keras.random.dropout(x[3:], rate, seed=5).numpy()
    assert np.array_equal(piece, keras.random.dropout(x, rate, seed=5).numpy()[3:])


def test_nested_slices_apply_innermost_and_restore_keras_function():
    x = tf.constant(np.random.default_rng(3).normal(size=(8, 6)).astype("float32"))
    full = keras.random.dropout(x, 0.5, seed=21).numpy()
    with global_batch_slice(3, GLOBAL_SIZE):
        with global_batch_slice(0, GLOBAL_SIZE):
            first = keras.random.dropout(x[:3], 0.5, seed=21).numpy()
        assert keras_tf_random.dropout is not KERAS_DROPOUT
        second = keras.random.dropout(x[3:], 0.5, seed=21).numpy()
    assert np.array_equal(np.concatenate([first, second]), full)
    assert keras_tf_random.dropout is KERAS_DROPOUT
    assert keras_backend.random.dropout is KERAS_DROPOUT


def test_keras_function_restored_after_an_error():
    with pytest.raises(RuntimeError, match="inside"), global_batch_slice(0, GLOBAL_SIZE):
        raise RuntimeError("inside")
    assert keras_tf_random.dropout is KERAS_DROPOUT


def test_other_threads_keep_plain_dropout():
    x = tf.ones((8, 6))
    plain = keras.random.dropout(x[:3], 0.5, seed=31).numpy()
    from_thread = []
    with global_batch_slice(5, GLOBAL_SIZE):
        worker = threading.Thread(
            target=lambda: from_thread.append(keras.random.dropout(x[:3], 0.5, seed=31).numpy())
        )
        worker.start()
        worker.join()
    assert np.array_equal(from_thread[0], plain)


def test_invalid_slices_are_refused():
    with pytest.raises(ValueError, match="offset"), global_batch_slice(-1, GLOBAL_SIZE):
        pass
    with pytest.raises(ValueError, match="global_size"), global_batch_slice(0, 0):
        pass
    assert keras_tf_random.dropout is KERAS_DROPOUT


class _OwnNoise(keras.layers.Layer):
    """A custom layer with its own generator, drawing noise of the input's shape."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noise_seed = keras.random.SeedGenerator(3)

    def call(self, inputs, training=False):
        return inputs + keras.random.normal(keras.ops.shape(inputs), seed=self.noise_seed)


def test_unsliceable_layers_are_listed_and_dropout_is_not():
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.GaussianNoise(0.1, name="noise"),
            keras.layers.RandomFlip(name="flip"),
            keras.layers.Dropout(0.5, name="dropout"),
        ]
    )
    assert unsliceable_random_layers(model) == ["noise", "flip"]


def test_unsliceable_rule_covers_nested_and_custom_layers():
    inner = keras.Sequential(
        [keras.Input((6,)), keras.layers.GaussianDropout(0.2, name="gaussian_dropout")],
        name="inner",
    )
    inputs = keras.Input((4, 6))
    attended = keras.layers.MultiHeadAttention(2, 3, dropout=0.3, name="mha")(inputs, inputs)
    recurrent = keras.layers.LSTM(6, dropout=0.2, recurrent_dropout=0.1, name="lstm")(attended)
    scored = keras.layers.Attention(dropout=0.1, name="attention")([attended, attended])
    outputs = [
        inner(recurrent),
        keras.layers.AlphaDropout(0.1, name="alpha_dropout")(recurrent),
        _OwnNoise(name="own_noise")(scored),
        keras.layers.SpatialDropout1D(0.2, name="spatial")(scored),
        keras.layers.GaussianNoise(0.0, name="no_noise")(recurrent),
    ]
    model = keras.Model(inputs, outputs)

    listed = unsliceable_random_layers(model)
    assert sorted(listed) == ["alpha_dropout", "gaussian_dropout", "own_noise"]
    without_custom = unsliceable_random_layers(model, extra_sliceable_types=(_OwnNoise,))
    assert sorted(without_custom) == ["alpha_dropout", "gaussian_dropout"]
    for layer in (keras.layers.RandomRotation(0.1), keras.layers.RandomContrast(0.2)):
        assert unsliceable_random_layers(layer) == [layer.name]


class _StochasticDepth(keras.layers.Layer):
    """keras_hub's DropPath (Swin): a uniform draw per sample, unless `drop_prob` is 0."""

    def __init__(self, drop_prob, **kwargs):
        super().__init__(**kwargs)
        self.drop_prob = drop_prob
        self.seed_generator = keras.random.SeedGenerator(1)

    def call(self, x, training=None):
        if self.drop_prob == 0.0 or not training:
            return x
        keep = keras.random.uniform((keras.ops.shape(x)[0], 1), seed=self.seed_generator)
        return x * keras.ops.floor(1.0 - self.drop_prob + keep) / (1.0 - self.drop_prob)


def test_random_layers_at_rate_zero_draw_nothing_and_are_not_listed():
    inputs = keras.Input((6,))
    outputs = [
        _StochasticDepth(0.0, name="depth_off")(inputs),
        _StochasticDepth(0.1, name="depth_on")(inputs),
        keras.layers.GaussianDropout(0.0, name="gaussian_off")(inputs),
        keras.layers.GaussianDropout(0.2, name="gaussian_on")(inputs),
    ]
    listed = unsliceable_random_layers(keras.Model(inputs, outputs))
    assert sorted(listed) == ["depth_on", "gaussian_on"]


def test_keras_hub_stochastic_depth_is_sliced_so_not_listed():
    inputs = keras.Input((3, 3, 4))
    swin = _hub_layer("swin_transformer.swin_transformer_layers", drop_prob=0.1, name="swin")
    mit = _hub_layer("mit.mit_layers", rate=0.1, name="mit")
    outputs = [swin(inputs), mit(inputs), _StochasticDepth(0.1, name="look_alike")(inputs)]
    # the look-alike draws the same way, but hyparflow knows only keras_hub's classes
    assert unsliceable_random_layers(keras.Model(inputs, outputs)) == ["look_alike"]
