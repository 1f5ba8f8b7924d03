"""engine/relaxed.py: a step is traced once, its batch size and varying lengths unknown, or once
per length for a model that reads a length as a Python int."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hyparflow import _keras
from hyparflow.engine.relaxed import Traces, declared_shapes, rows_unknown
from hyparflow.engine.stages.fused import FusedRunner
from hyparflow.engine.stages.split_stage import SplitStageRunner
from hyparflow.engine.stages.stage import StageRunner
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

    function, traces = traced(step, reduce_retracing=True), Traces(declared)
    for length, batch in ((7, 4), (5, 4), (9, 3), (2, 1)):
        x, y = _batch(length, batch)
        traces.ready(function, (x, y, None), targets=(1, 2))(x, y, None)
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
    Traces(declared_shapes(model, None)).ready(function, (x,))(x)
    assert seen == [[4, 3]]


def test_inputs_of_another_structure_trace_as_they_come():
    """A structure the declared shapes do not describe is traced exactly (no relaxation)."""
    function = traced(lambda x: tf.reduce_sum(x), reduce_retracing=True)
    Traces([(None,), (None,)]).ready(function, (np.ones((4, 7), "float32"),))
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


@keras.saving.register_keras_serializable(package="test_relaxed")
class _Unrolled(keras.layers.Layer):
    """Decays its sequence into its last step with a Python loop over the steps, as RWKV-7's
    kernel does: its length must be a Python int. With `batch_as_int`, its batch size too."""

    def __init__(self, batch_as_int=False, **kwargs):
        super().__init__(**kwargs)
        self.batch_as_int = batch_as_int

    def call(self, x):
        total = x[:, 0]
        for t in range(1, int(x.shape[1])):
            total = total * 0.5 + x[:, t]
        if self.batch_as_int:
            total = tf.reshape(total, (int(x.shape[0]), -1))
        return total

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[2])


def _unrolled_model(batch_as_int=False):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((None, 3))
    x = keras.layers.Dense(4, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(_Unrolled(batch_as_int)(x)))


def _sequences(rows, length, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, length, 3)).astype("float32")


def test_a_model_that_reads_a_length_as_an_int_is_traced_once_per_length():
    """Its relaxed trace raises: it is traced per length with the batch size unknown (Keras's
    fit relaxes the batch size too), and computes what the model computes eagerly."""
    model = _unrolled_model()
    seen = []

    def forward(x):
        seen.append(x.shape.as_list())
        return model(x)

    function, traces = traced(forward, reduce_retracing=True), Traces(declared_shapes(model, None))
    for rows, length in ((4, 7), (3, 7), (4, 5), (1, 5), (2, 9), (4, 7)):
        x = _sequences(rows, length)
        got = traces.ready(function, (x,))(x)
        np.testing.assert_allclose(got.numpy(), model(x).numpy(), rtol=1e-6)
    assert seen[0] == [None, None, 3]  # the relaxed trace, which raised
    assert seen[1:] == [[None, 7, 3], [None, 5, 3], [None, 9, 3]]
    assert function.experimental_get_tracing_count() == 0 and traces.tracing_count(function) == 3


def test_a_model_that_reads_its_batch_size_as_an_int_is_traced_per_shape():
    model = _unrolled_model(batch_as_int=True)
    function, traces = traced(model, reduce_retracing=True), Traces(declared_shapes(model, None))
    shapes = ((4, 7), (3, 7), (4, 7), (4, 5))
    for rows, length in shapes:
        x = _sequences(rows, length)
        got = traces.ready(function, (x,))(x)
        np.testing.assert_allclose(got.numpy(), model(x).numpy(), rtol=1e-6)
    assert traces.tracing_count(function) == 3  # one per distinct shape


class _Broken(keras.layers.Layer):
    def call(self, x):
        raise ValueError("a genuine error at every shape")

    def compute_output_shape(self, input_shape):
        return input_shape


def test_an_error_at_the_data_shapes_too_is_raised_as_it_is():
    inputs = keras.Input((None, 3))
    model = keras.Model(inputs, _Broken()(inputs))
    function, traces = traced(model, reduce_retracing=True), Traces(declared_shapes(model, None))
    x = _sequences(2, 4)
    with pytest.raises(ValueError, match="a genuine error at every shape"):
        traces.ready(function, (x,))(x)


def _mse(y, y_pred, sample_weight):
    return tf.reduce_mean(tf.square(y - y_pred))


RUNNERS = ("fused", "stage", "recompute", "split", "first_stage")


def _length_runner(kind, model):
    call = lambda inputs, training: model(inputs, training=training)  # noqa: E731
    options = dict(input_shapes=declared_shapes(model, None))
    variables = model.trainable_variables
    if kind == "fused":
        return FusedRunner(call, variables, loss=_mse, microbatches=2, **options)
    if kind == "first_stage":
        return StageRunner(call, variables, input_grads=False, **options)
    if kind == "split":
        layers = _keras.all_layers(model)
        return SplitStageRunner(call, variables, loss=_mse, layers=layers, **options)
    return StageRunner(call, variables, loss=_mse, recompute=kind == "recompute", **options)


def _expected_step(model, batches, last: bool) -> list:
    """The step's gradients, taken eagerly: each micro-batch's loss weighted by its rows (at
    the last stage), or its outputs against their gradients."""
    rows = sum(len(x) for x, _ in batches)
    total = [tf.zeros_like(v) for v in model.trainable_variables]
    for x, y in batches:
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            target = _mse(y, outputs, None) * len(x) / rows if last else tf.reduce_sum(outputs * y)
        grads = tape.gradient(target, model.trainable_variables)
        total = [t + g for t, g in zip(total, grads, strict=True)]
    return total


@pytest.mark.parametrize("kind", RUNNERS)
def test_every_runner_trains_a_model_that_reads_a_length_as_an_int(kind):
    """Whole-model step, taped stage (its recomputation too), a stage whose backward would be
    split (it runs merged: its taps would take a shape per length), a first stage, and
    inference: each function is traced once per length, and computes Keras's gradients."""
    model = _unrolled_model()
    if kind == "split":
        with pytest.warns(UserWarning, match="cannot be traced with its lengths unknown"):
            runner = _length_runner(kind, model)
            _run_steps(runner, model, kind, [(7, (4, 3))])
        assert not runner.split
    else:
        runner = _length_runner(kind, model)
    _run_steps(runner, model, kind, [(7, (4, 3)), (5, (4, 3)), (7, (2, 2))])
    names = ("_first_fn", "_accumulate_fn", "_forward_fn", "_loss_forward_fn")
    functions = [getattr(runner, name) for name in names if hasattr(runner, name)]
    assert max(runner._traces.tracing_count(f) for f in functions) == 2  # lengths 7 and 5
    for rows, length in ((3, 9), (5, 9), (2, 4)):
        x = tf.constant(_sequences(rows, length))
        np.testing.assert_allclose(runner.infer(x).numpy(), model(x).numpy(), rtol=1e-6)
    assert runner._traces.tracing_count(runner._infer_fn) == 2  # lengths 9 and 4


def _run_steps(runner, model, kind, steps):
    last = kind != "first_stage"
    for step, (length, sizes) in enumerate(steps):
        batches = [
            (
                tf.constant(_sequences(rows, length, seed=10 * step + k)),
                tf.constant(np.random.default_rng(k).normal(size=(rows, 2)).astype("float32")),
            )
            for k, rows in enumerate(sizes)
        ]
        for k, (x, y) in enumerate(batches):
            if last:
                runner.forward(k, x, targets=(y, None), scale=len(x) / sum(sizes))
            else:
                runner.forward(k, x, scale=len(x) / sum(sizes))
        for k, (_, y) in enumerate(batches):
            runner.backward(k, None if last else [y])
            runner.weight(k)
        expected = _expected_step(model, batches, last)
        for got, want in zip(runner.take_gradients(), expected, strict=True):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)
