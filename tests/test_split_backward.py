"""A backward split into input gradients (B) and weight gradients (W) sums to the merged one.

`SplitStageRunner` (engine/stages/split_stage.py, weight taps in engine/stages/weight_taps.py)
against `StageRunner` on the same weights and micro-batches, in one process: the input gradients
each B returns and the weight gradients the W passes sum must be the merged backward's; what cannot
be split runs merged and says why.
"""

import contextlib
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from hyparflow import _keras
from hyparflow.engine.gradients.sparse import row_sparse_positions
from hyparflow.engine.relaxed import declared_shapes
from hyparflow.engine.stages import tap_shapes
from hyparflow.engine.stages.split_stage import SplitStageRunner
from hyparflow.engine.stages.stage import StageRunner
from hyparflow.moe import SparseDispatch

TOLERANCE = 1e-5


def _mlp():
    x = keras.Input((6,))
    h = keras.layers.Dense(12, activation="relu")(x)  # tapped before its ReLU
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Dense(12, activation="gelu")(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def _batchnorm():
    x = keras.Input((6,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(12)(x))
    return keras.Model(x, keras.layers.Dense(3, activation="tanh")(h))


def _tokens():
    """Variable-length token ids and a padding mask: taps shaped by the batch's length."""
    ids, mask = keras.Input((None,), dtype="int32"), keras.Input((None,), dtype="float32")
    h = keras.layers.Embedding(20, 8)(ids)
    h = keras.layers.Dense(8, activation="relu")(h) * keras.ops.expand_dims(mask, -1)
    return keras.Model([ids, mask], keras.layers.Dense(3)(h))


def _pair():
    """Two inputs of independent lengths: a tap follows the second one's."""
    a, b = keras.Input((None, 4)), keras.Input((None, 4))
    pooled = keras.ops.mean(keras.layers.Dense(5)(a), axis=1, keepdims=True)
    return keras.Model([a, b], keras.layers.Dense(3)(b) + keras.layers.Dense(3)(pooled))


class _Tied(keras.layers.Layer):
    """Reads another layer's kernel: the split would miss that use of it."""

    def __init__(self, dense):
        super().__init__()
        self.dense = dense

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.dense.kernel))


def _tied():
    x = keras.Input((6,))
    dense = keras.layers.Dense(6)
    h = dense(x)
    return keras.Model(x, _Tied(dense)(h))


def _recurrent():
    x = keras.Input((5, 4))
    return keras.Model(x, keras.layers.Dense(3)(keras.layers.GRU(6)(x)))


class _Noisy(keras.layers.Layer):
    """Owns a kernel and drops out inside its call: a replay would draw another mask."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 3))
        self.dropout = keras.layers.Dropout(0.5)

    def call(self, x, training=None):
        return self.dropout(keras.ops.matmul(x, self.kernel), training=training)


def _noisy():
    x = keras.Input((6,))
    return keras.Model(x, _Noisy()(keras.layers.Dense(6)(x)))


def _half():
    x = keras.Input((6,))
    h = keras.layers.Dense(8, dtype="mixed_float16")(x)
    return keras.Model(x, keras.layers.Dense(3)(h))


def _runner(cls, build, **options):
    keras.utils.set_random_seed(3)
    model = build()
    layers = _keras.all_layers(model)
    if cls is SplitStageRunner:
        options["layers"] = layers
    options["sparse"] = row_sparse_positions(model.trainable_variables, layers)
    options["input_shapes"] = declared_shapes(model, None)
    call = lambda inputs, training: model(inputs, training=training)  # noqa: E731
    return model, cls(call, model.trainable_variables, **options)


def _microbatches(model, sizes):
    """Inputs for each (rows, length) (a length per input, or one for all) and gradients for
    their outputs."""
    rng = np.random.default_rng(0)
    batches = []
    for rows, lengths in sizes:
        inputs = []
        if not isinstance(lengths, tuple):
            lengths = (lengths,) * len(model.inputs)
        for spec, length in zip(model.inputs, lengths, strict=True):
            shape = [rows, *(length if d is None else d for d in spec.shape[1:])]
            if spec.dtype == "int32":
                inputs.append(tf.constant(rng.integers(0, 20, shape), tf.int32))
            else:
                inputs.append(tf.constant(rng.normal(size=shape), tf.float32))
        outputs = model(inputs)
        batches.append((inputs, tf.constant(rng.normal(size=outputs.shape), tf.float32)))
    return batches


def _step(runner, batches, order):
    """Forward every micro-batch, then backward (and W) in `order`; the input and weight
    gradients."""
    for k, (inputs, _) in enumerate(batches):
        runner.forward(k, inputs)
    input_grads = {}
    for k in order:
        input_grads[k] = runner.backward(k, [batches[k][1]])
    for k in order:
        runner.weight(k)
    return [input_grads[k] for k in range(len(batches))], runner.take_gradients()


def _difference(a, b) -> float:
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None or y is not None]
    dense = [(tf.convert_to_tensor(x), tf.convert_to_tensor(y)) for x, y in pairs]
    return max(float(np.max(np.abs(x.numpy() - y.numpy()))) for x, y in dense)


def _compare(build, sizes, order=None, steps=2, **options):
    runs = []
    for cls in (StageRunner, SplitStageRunner):
        model, runner = _runner(cls, build, **options)
        batches = _microbatches(model, sizes)
        results = [_step(runner, batches, order or range(len(sizes))) for _ in range(steps)]
        runs.append((model, runner, results))
    (merged_model, _, merged), (split_model, runner, split) = runs
    for (inputs_a, weights_a), (inputs_b, weights_b) in zip(merged, split, strict=True):
        for a, b in zip(inputs_a, inputs_b, strict=True):
            assert _difference(a, b) < TOLERANCE
        assert _difference(weights_a, weights_b) < TOLERANCE
    assert _difference(merged_model.get_weights(), split_model.get_weights()) < TOLERANCE
    return runner


@pytest.mark.parametrize("build", [_mlp, _batchnorm], ids=["mlp", "batchnorm"])
def test_split_backward_sums_to_the_merged_one(build):
    runner = _compare(build, [(4, None), (4, None), (3, None)], order=[1, 0, 2])
    assert runner.split and not runner.refusals
    # B computed no weight gradient: W gave them all, traced once for both sizes
    assert runner._weight_fn.experimental_get_tracing_count() == 1
    assert runner._split_forward_fn.experimental_get_tracing_count() == 1


def test_recomputation_splits_its_backward_too():
    assert _compare(_mlp, [(4, None), (2, None)], recompute=True).split


def test_taps_follow_the_batch_length():
    runner = _compare(_tokens, [(2, 5), (2, 7), (3, 4)])
    assert runner.split
    assert runner._split_forward_fn.experimental_get_tracing_count() == 1


def test_a_tap_equal_to_two_input_lengths_is_told_apart_when_they_differ():
    # equal lengths first (the tap's length could be either input's), then different ones
    runner = _compare(_pair, [(2, 4), (2, (4, 6))])
    lengths = [shape[1] for shape in runner._shapes if not isinstance(shape[1], int)]
    # Dense(5) on the first input, Dense(3) on the second: each follows its own length
    assert lengths == [frozenset({(0, 1)}), frozenset({(1, 1)})], runner._shapes


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (_tied, "read outside a call of its layer"),
        (_recurrent, "inside a loop or nested function"),
        (_half, "computes in float16"),
        (_noisy, "draws random numbers"),
    ],
    ids=["tied", "recurrent", "float16", "random"],
)
def test_what_cannot_be_split_runs_merged_and_says_why(build, reason):
    with pytest.warns(UserWarning, match="runs its backward whole"):
        runner = _compare(build, [(3, None), (3, None)], steps=1)
    assert not runner.split
    assert any(reason in r for r in runner.refusals), runner.refusals


def test_batchnorm_summed_across_replicas_runs_merged():
    with pytest.warns(UserWarning, match="summed across replicas"):
        runner = _compare(_batchnorm, [(3, None)], steps=1, train_scope=contextlib.nullcontext)
    assert not runner.split


def test_tap_shapes_refuse_a_length_that_follows_no_input():
    varying = [(None, None)]
    assert tap_shapes.template([(None, None)], [(2, 14)], [(2, 7)], varying).startswith("a tap")
    shapes = tap_shapes.template([(None, None)], [(2, 7)], [(2, 7), (2, 7)], varying * 2)
    assert tap_shapes.resolve(shapes, [(5, 3), (5, 3)]) == [(5, 3)]
    assert "follows no input" in tap_shapes.narrow(shapes, [(5, 4)], [(5, 3), (5, 6)])


def _mixture():
    """keras_hub's Qwen3-MoE block on tokens of varying length (router loss off)."""
    from keras_hub.src.models.qwen3_moe.qwen3_moe_decoder import Qwen3SparseMoeBlock

    x = keras.Input((None, 8))
    block = Qwen3SparseMoeBlock(
        8, 4, num_experts=4, top_k=2, norm_top_k_prob=True, router_aux_loss_coefficient=0.0
    )
    mixed, _ = block(x)
    return keras.Model(x, keras.layers.Dense(3)(mixed))


def test_sparse_expert_dispatch_runs_merged_and_says_why():
    """Under ZB-H1 a mixture stage (sparse experts or keras_hub's dense ones) runs merged: its
    router and experts see batch x length tokens as one dimension, which no tap shape follows."""
    dispatches = contextlib.ExitStack()

    def build():
        model = _mixture()
        assert dispatches.enter_context(SparseDispatch(model)).blocks
        return model

    with dispatches:
        runner = _compare(build, [(2, 5), (3, 4)], order=[1, 0])
    assert not runner.split
    assert runner.refusals == [
        "a tapped output has a varying dimension (10) equal to no varying input dimension"
    ]


def _instance_call():
    """A Dense with a call of its own instance (as hyparflow.moe's sparse experts have)."""
    x = keras.Input((6,))
    dense = keras.layers.Dense(5)

    def doubled(self, inputs, training=None):
        return 2.0 * keras.ops.matmul(inputs, self.kernel) + self.bias

    object.__setattr__(dense, "call", types.MethodType(doubled, dense))
    return keras.Model(x, keras.layers.Dense(3)(dense(x)))


def test_a_call_of_the_instance_is_tapped_replayed_and_kept():
    runner = _compare(_instance_call, [(4, None), (3, None)], order=[1, 0])
    assert runner.split and not runner.refusals, runner.refusals
    owners = {id(layer): layer for layer in runner._owners.values()}.values()
    own = [layer for layer in owners if "call" in vars(layer)]  # restored after each trace
    assert len(own) == 1 and own[0].call.__func__.__name__ == "doubled"
