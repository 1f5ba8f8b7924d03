"""engine/relaxed.py: a step is traced once, its batch size and varying lengths unknown."""

import keras
import numpy as np
import tensorflow as tf

from hyparflow.engine.relaxed import declared_shapes, rows_unknown, trace_first
from hyparflow.traced import traced


def _token_model():
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    mask = keras.Input((None,), dtype="int32", name="mask")
    width = keras.Input((3,), name="width")
    embedded = keras.layers.Embedding(10, 4)(tokens * mask)
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)
    return keras.Model({"tokens": tokens, "mask": mask, "width": width}, pooled + width[:, :1])


def _batch(length, batch=4):
    x = {
        "tokens": np.ones((batch, length), "int32"),
        "mask": np.ones((batch, length), "int32"),
        "width": np.ones((batch, 3), "float32"),
    }
    return x, np.zeros((batch, length), "int32")


def test_declared_shapes_follow_the_inputs_flattened_order_batch_first():
    assert declared_shapes(_token_model(), None) == [(None, None), (None, None), (None, 3)]
    fixed = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    assert declared_shapes(fixed, None) == [(None, 5)]
    fixed_batch = keras.Sequential([keras.Input(batch_shape=(8, 5)), keras.layers.Dense(2)])
    assert declared_shapes(fixed_batch, None) == [(8, 5)]


class _Subclassed(keras.Model):
    def call(self, x):
        return x


def test_a_model_without_declared_inputs_has_no_declared_shapes():
    assert declared_shapes(_Subclassed(), None) is None


def test_one_trace_serves_every_length_and_batch_size():
    model = _token_model()
    declared = declared_shapes(model, None)
    seen = []

    def step(x, y, sample_weight):
        seen.append((x["tokens"].shape.as_list(), x["width"].shape.as_list(), y.shape.as_list()))
        return tf.reduce_sum(model(x)) + tf.cast(tf.reduce_sum(y), tf.float32)

    function = traced(step, reduce_retracing=True)
    for length, batch in ((7, 4), (5, 4), (9, 3), (2, 1)):
        x, y = _batch(length, batch)
        trace_first(function, (x, y, None), declared, targets=(1, 2))
        function(x, y, None)
    assert function.experimental_get_tracing_count() == 1
    assert seen == [([None, None], [None, 3], [None, None])]


def test_a_fixed_batch_size_stays_known():
    """A model whose input fixes its batch size (`batch_shape`) is traced with that size."""
    inputs = keras.Input(batch_shape=(4, 3))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    seen = []

    def step(x):
        seen.append(x.shape.as_list())
        return model(x)

    function = traced(step, reduce_retracing=True)
    x = np.ones((4, 3), "float32")
    trace_first(function, (x,), declared_shapes(model, None))
    function(x)
    assert seen == [[4, 3]]


def test_inputs_of_another_structure_trace_as_they_come():
    """A structure the declared shapes do not describe is traced exactly (no relaxation)."""
    function = traced(lambda x: tf.reduce_sum(x), reduce_retracing=True)
    trace_first(function, (np.ones((4, 7), "float32"),), [(None,), (None,)])
    concrete = function.get_concrete_function(tf.TensorSpec((4, 7), tf.float32))
    assert function.experimental_get_tracing_count() == 1
    assert concrete.structured_input_signature[0][0].shape.as_list() == [4, 7]


def _rows(count: int) -> tf.IndexedSlices:
    """An embedding table's gradient (10 rows of 4) holding `count` rows."""
    return tf.IndexedSlices(tf.ones((count, 4)), tf.range(count), tf.constant([10, 4]))


def test_an_update_of_row_slices_traces_once_for_every_row_count():
    table = tf.Variable(tf.zeros((10, 4)))

    def update(grads, scale):
        table.scatter_add(tf.IndexedSlices(grads[0].values * scale, grads[0].indices))

    plain = traced(update, reduce_retracing=True)
    once = traced(update, reduce_retracing=True)
    relaxed = rows_unknown(once)
    for count in (3, 5, 2):
        plain([_rows(count)], tf.constant(1.0))
        relaxed([_rows(count)], tf.constant(1.0))
    assert plain.experimental_get_tracing_count() == 2  # by shape: once more for the 5 rows
    assert once.experimental_get_tracing_count() == 1
    np.testing.assert_array_equal(table.numpy()[:2], np.full((2, 4), 6.0))  # all six calls ran


def test_an_update_without_row_slices_is_traced_as_it_comes():
    dense = rows_unknown(traced(lambda grads: grads[0] * 2, reduce_retracing=True))
    assert float(dense([tf.constant(3.0)])) == 6.0
