"""StageRunner on one process: gradients, micro-batch accumulation and recomputation."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from hyparflow import deferred
from hyparflow.engine.gradients import flat
from hyparflow.engine.gradients.flat import FlatLayout
from hyparflow.engine.keras_semantics.metrics import build_outside_the_trace
from hyparflow.engine.relaxed import declared_shapes
from hyparflow.engine.stages.fused import FusedRunner
from hyparflow.engine.stages.segments import SegmentedRunner
from hyparflow.engine.stages.stage import StageRunner
from tests.support.mpirun import POOLED_ALLOCATOR_ENV


def _model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    x = keras.layers.Dense(8, use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.4)(x)
    outputs = keras.layers.Dense(2)(x)
    model = keras.Model(inputs, outputs)
    model.compile(loss="mse", optimizer="sgd")
    return model


def _state(model):
    layers = model._flatten_layers(include_self=False)
    seeds = [g.state for layer in layers for g in getattr(layer, "_seed_generators", [])]
    return list(model.non_trainable_variables) + seeds


def _calls(model) -> tuple:
    """What a runner takes of a stage that is the whole `model`: its call, its trainable
    variables and its compiled loss."""

    def call(inputs, training):
        return model(inputs, training=training)

    def loss(y_true, y_pred, sample_weight):
        return model._compile_loss(y_true, y_pred, sample_weight)

    return call, model.trainable_variables, loss


def _data():
    """12 samples of 5 features and 2 targets, the same every call (pieces of 8 and 4)."""
    x = np.random.default_rng(0).normal(size=(12, 5)).astype("float32")
    y = np.random.default_rng(1).normal(size=(12, 2)).astype("float32")
    return x, y


def _run(recompute: bool, flat: bool = False):
    model = _model()
    x, y = _data()
    runner = StageRunner(
        *_calls(model),
        recompute=recompute,
        state_variables=_state(model) if recompute else (),
        layout=FlatLayout(model.trainable_variables) if flat else None,
    )
    for k, part in enumerate((slice(0, 8), slice(8, 12))):
        runner.forward(k, tf.constant(x[part]), (tf.constant(y[part]), None), scale=1.0)
    kept_tapes = [tape is not None for tape, _ in runner._pending.values()]
    for k in (1, 0):
        runner.backward(k)
    stats = [np.array(v.numpy()) for v in model.non_trainable_variables]
    return runner.take_gradients(), stats, kept_tapes


@pytest.fixture(scope="module")
def runs():
    return _run(recompute=False), _run(recompute=True)


def test_recompute_keeps_no_tape_between_forward_and_backward(runs):
    (_, _, stored), (_, _, recomputed) = runs
    assert stored == [True, True]
    assert recomputed == [False, False]


def test_recompute_gives_the_same_gradients_dropout_masks_included(runs):
    (plain, _, _), (again, _, _) = runs
    for a, b in zip(plain, again, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_recompute_does_not_update_batchnorm_statistics_twice(runs):
    (_, plain_stats, _), (_, recomputed_stats, _) = runs
    for a, b in zip(plain_stats, recomputed_stats, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("recompute", [False, True])
def test_flat_layout_gives_the_same_gradients_statistics_and_dropout(runs, recompute):
    """Variables read from views of one flat tensor: the gradient comes back flat and equal
    to the per-variable one, BatchNormalization statistics and Dropout masks included."""
    (plain, plain_stats, _) = runs[recompute]
    grads, stats, _ = _run(recompute=recompute, flat=True)
    for a, b in zip(plain, grads, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    for a, b in zip(plain_stats, stats, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_gathered_weights_give_the_same_gradients_statistics_dropout_and_inference(runs):
    """ZeRO-3's runner: its variables hold no value (let go), every call reads the values
    `gather` returns and differentiates them, and what the call assigns (BatchNormalization
    statistics, Dropout seeds) still reaches the variables that hold values."""
    model = _model()
    x, y = _data()
    values = [tf.constant(v.numpy()) for v in model.trainable_variables]
    gather = _Values(values)
    calls = gather.calls
    deferred.take_over(model.trainable_variables, "held by the test's gather")
    deferred.let_go(model.trainable_variables)
    with pytest.raises(deferred.NotHeldError, match="held by the test's gather"):
        model.trainable_variables[0].numpy()
    call, variables, loss = _calls(model)
    runner = StageRunner(
        call, variables, loss, recompute=True, state_variables=_state(model), gather=gather
    )
    for k, part in enumerate((slice(0, 8), slice(8, 12))):
        runner.forward(k, tf.constant(x[part]), (tf.constant(y[part]), None), scale=1.0)
    for k in (1, 0):
        runner.backward(k)
    assert len(calls) == 4  # each forward, each recomputation: the values live only then
    (plain, plain_stats, _) = runs[True]
    for a, b in zip(plain, runner.take_gradients(), strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    for a, v in zip(plain_stats, model.non_trainable_variables, strict=True):
        np.testing.assert_allclose(a, v.numpy(), rtol=1e-6)
    inferred = runner.infer(tf.constant(x)).numpy()
    for variable, value in zip(model.trainable_variables, values, strict=True):
        deferred.hold(variable, value)
    np.testing.assert_allclose(model(x, training=False).numpy(), inferred, rtol=1e-6)


class _Values:
    """A `WeightSource` of fixed values that counts its calls."""

    def __init__(self, values):
        self.values, self.calls = values, []

    def __call__(self):
        self.calls.append(1)
        return self.values

    def prefetch(self):
        pass


@pytest.mark.parametrize(
    "order, gathers, reused",
    [
        # each backward right after its forward (1F1B at P=1): no recomputation, no gather
        (("F0", "B0", "F1", "B1"), 2, 2),
        # the last forward's backward comes first: only that one is reused
        (("F0", "F1", "B1", "B0"), 3, 1),
        # another micro-batch's backward first: the kept tape is let go, both recompute
        (("F0", "F1", "B0", "B1"), 4, 0),
    ],
)
def test_a_reused_forward_gives_the_recomputed_gradients_and_saves_its_gather(
    runs, order, gathers, reused
):
    """ZeRO-3's last segment (`reuse_forward`): a backward that follows its own forward
    differentiates the kept tape; any other forward or backward first lets the tape go, and
    the backward recomputes, with the same Dropout masks and statistics either way."""
    model = _model()
    x, y = _data()
    values = [tf.constant(v.numpy()) for v in model.trainable_variables]
    deferred.take_over(model.trainable_variables, "held by the test's gather")
    deferred.let_go(model.trainable_variables)
    gather = _Values(values)
    runner = StageRunner(
        *_calls(model),
        recompute=True,
        state_variables=_state(model),
        gather=gather,
        reuse_forward=True,
    )
    parts = (slice(0, 8), slice(8, 12))
    for action in order:
        k = int(action[1])
        if action[0] == "F":
            runner.forward(k, tf.constant(x[parts[k]]), (tf.constant(y[parts[k]]), None))
        else:
            runner.backward(k)
    assert (len(gather.calls), runner.reused_forwards) == (gathers, reused)
    (plain, plain_stats, _) = runs[True]
    for a, b in zip(plain, runner.take_gradients(), strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    for a, v in zip(plain_stats, model.non_trainable_variables, strict=True):
        np.testing.assert_allclose(a, v.numpy(), rtol=1e-6)


def test_reusing_a_forward_needs_recompute():
    model = _model()
    with pytest.raises(ValueError, match="reuse_forward saves a recomputation"):
        StageRunner(*_calls(model), reuse_forward=True)


def test_a_gathering_runner_must_recompute():
    model = _model()
    with pytest.raises(ValueError, match="recomputes"):
        StageRunner(*_calls(model), gather=lambda: [])


def test_flat_layout_middle_stage_and_fresh_values_each_step():
    """A middle stage: same input gradients; the flat gradient is one tensor, whether the
    backward differentiates it or the per-variable sums are flattened when taken; after the
    variables change between steps, the next step differentiates the new values."""
    model = _dense_stage()
    x = tf.constant(np.random.default_rng(6).normal(size=(5, 6)).astype("float32"))
    upstream = [tf.constant(np.random.default_rng(7).normal(size=(5, 3)).astype("float32"))]
    layout = FlatLayout(model.trainable_variables)
    runners = [
        StageRunner(lambda i, training: model(i, training=training), model.trainable_variables),
        StageRunner(
            lambda i, training: model(i, training=training),
            model.trainable_variables,
            layout=layout,
        ),
        StageRunner(
            lambda i, training: model(i, training=training),
            model.trainable_variables,
            layout=layout,
            flat_backward=False,
        ),
    ]
    for _ in range(2):  # two steps
        results = []
        for runner in runners:
            for k in range(2):
                runner.forward(k, x)
                results.append(runner.backward(k, upstream))
        plain_in = results[0][0].numpy()
        for (other_in,) in results[1:]:
            np.testing.assert_allclose(plain_in, other_in.numpy(), rtol=1e-6)
        assert runners[2]._params is None  # per-variable backward: nothing packed
        plain = runners[0].take_gradients()
        for runner in runners[1:]:
            packed = runner.take_flat_gradients()
            assert packed.shape == (layout.length,)
            for a, b in zip(plain, layout.unflatten_fn(packed), strict=True):
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
        for v in model.trainable_variables:  # an optimizer step between the two steps
            v.assign(v * 0.5 + 0.1)
    for runner in runners[1:]:
        assert not np.any(runner.take_flat_gradients().numpy())  # nothing since: zeros


def test_table_gradients_stay_row_slices_beside_the_flat_layout():
    """A gather's gradient is row slices (IndexedSlices), one pair per looked-up id in order,
    with or without a flat layout of the other variables; a table the stage's loss does not
    reach contributes no rows."""
    keras.utils.set_random_seed(8)
    inputs = keras.Input((3,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(10, 4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    table, dense = model.trainable_variables[0], model.trainable_variables[1:]
    ids = [tf.constant([[1, 2, 2], [7, 1, 0]]), tf.constant([[4, 4, 9]])]
    grads = []
    for layout in (None, FlatLayout(dense)):
        runner = StageRunner(
            lambda i, training: model(i, training=training),
            model.trainable_variables,
            input_grads=False,
            layout=layout,
            sparse=[0],
        )
        for k, batch in enumerate(ids):
            runner.forward(k, batch)
            assert runner.backward(k, [tf.ones((batch.shape[0], 2))]) == [None]
        grads.append(runner.take_gradients())
    for got in grads:
        assert isinstance(got[0], tf.IndexedSlices)
        assert got[0].indices.numpy().tolist() == [1, 2, 2, 7, 1, 0, 4, 4, 9]  # both pieces
    np.testing.assert_array_equal(grads[0][0].values.numpy(), grads[1][0].values.numpy())
    for a, b in zip(grads[0][1:], grads[1][1:], strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
    unused = StageRunner(lambda i, training: i, [table], input_grads=True, sparse=[0])
    unused.forward(0, tf.ones((2, 3)))
    unused.backward(0, [tf.ones((2, 3))])
    (none,) = unused.take_gradients()
    assert isinstance(none, tf.IndexedSlices) and none.values.shape == (0, 4)


def test_a_gathered_variable_outside_an_embedding_is_refused_not_densified():
    keras.utils.set_random_seed(8)
    inputs = keras.Input((3,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(10, 4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    runner = StageRunner(
        lambda i, training: model(i, training=training),
        model.trainable_variables,
        input_grads=False,
    )
    runner.forward(0, tf.constant([[1, 2, 3]]))
    with pytest.raises(ValueError, match="row-sparse gradients"):
        runner.backward(0, [tf.ones((1, 2))])


def test_take_gradients_hands_over_the_sum_and_resets():
    model = _model()
    model.layers[3].rate = 0.0  # no dropout: compare with one full-batch gradient
    x = tf.random.stateless_normal((6, 5), seed=(1, 2))
    y = tf.random.stateless_normal((6, 2), seed=(3, 4))
    runner = StageRunner(
        *_calls(model),
    )
    runner.forward(0, x, (y, None), scale=1.0)
    runner.backward(0)
    (whole,) = [runner.take_gradients()]
    assert all(float(tf.reduce_sum(tf.abs(g))) == 0 for g in runner.take_gradients())
    assert len(whole) == len(model.trainable_variables)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_fused_runner_matches_the_taped_stage_runner_and_updates_metrics(microbatches):
    """FusedRunner (one compiled forward+backward) accumulates the same gradients over
    micro-batches as StageRunner, Dropout and BatchNormalization included. Told that a step has
    several micro-batches, it sums every one into zeros: one function, traced once with the
    batch size unknown (engine/relaxed.py), whatever the micro-batches' sizes."""
    reference, stats, _ = _run(recompute=False)
    model = _model()
    seen = []
    x, y = _data()
    runner = FusedRunner(
        *_calls(model),
        metrics=lambda yt, yp, sw: seen.append(yp.shape[0]),  # runs while tracing
        microbatches=microbatches,
        input_shapes=declared_shapes(model, None),
    )
    for k, part in enumerate((slice(0, 8), slice(8, 12))):
        y_pred, loss = runner.forward(k, tf.constant(x[part]), (tf.constant(y[part]), None))
        assert y_pred.shape[0] == part.stop - part.start and loss.shape == ()
    traced = [None] * (2 if microbatches == 1 else 1)  # sizes seen while tracing: unknown
    assert runner.in_flight == 2 and runner.updates_metrics and seen == traced
    assert runner.backward(1) == [] and runner.backward(0) == [] and runner.in_flight == 0
    for got, want in zip(runner.take_gradients(), reference, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    for got, want in zip(model.non_trainable_variables, stats, strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    zeros = runner.take_gradients()  # nothing forwarded since: zeros
    assert all(not np.any(g.numpy()) for g in zeros)
    traces = (
        runner._first_fn.experimental_get_tracing_count(),
        runner._accumulate_fn.experimental_get_tracing_count(),
    )
    assert traces == ((1, 1) if microbatches == 1 else (0, 1))


def test_flat_layout_round_trips_gradients_with_aligned_pieces():
    layout = flat.FlatLayout([tf.TensorSpec((3,)), tf.TensorSpec((2, 5)), tf.TensorSpec(())])
    assert all(slot.offset % 16 == 0 for slot in layout.slots)  # 64-byte aligned float32
    grads = [tf.random.normal(s.shape) for s in layout.slots]
    packed = layout.flatten(grads, tf.constant(2.5))
    assert packed.shape == (layout.length,) and layout.length % 16 == 0
    assert np.all(packed.numpy()[layout.tail_offset :] == 2.5)
    for got, want in zip(layout.unflatten_fn(packed), grads, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert not flat.FlatLayout([tf.TensorSpec((2,), tf.float16)]).usable


def _dense_stage():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(4, activation="tanh")(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(loss="mse", optimizer="sgd", metrics=["mae"])
    return model


def test_first_stage_skips_input_gradients_and_keeps_variable_gradients():
    model = _dense_stage()
    x = tf.constant(np.random.default_rng(2).normal(size=(5, 6)).astype("float32"))
    upstream = [tf.ones((5, 3))]
    results = []
    for input_grads in (True, False):
        runner = StageRunner(
            lambda inputs, training: model(inputs, training=training),
            model.trainable_variables,
            input_grads=input_grads,
        )
        runner.forward(0, x)
        returned = runner.backward(0, upstream)
        results.append((returned, runner.take_gradients()))
    (with_inputs, grads), (without, same_grads) = results
    assert with_inputs[0] is not None and with_inputs[0].shape == (5, 6)
    assert without == [None]
    for a, b in zip(grads, same_grads, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
    # The backward graph no longer holds the input gradient at all (not just discards it).
    runner = StageRunner(
        lambda inputs, training: model(inputs, training=training),
        model.trainable_variables,
        input_grads=False,
    )
    graph = runner._forward_fn.get_concrete_function(x, tf.constant(1.0), None, None).graph
    assert any(op.type == "StopGradient" for op in graph.get_operations())


@pytest.mark.parametrize("recompute", [False, True])
def test_last_stage_updates_metrics_inside_its_call_once_per_forward(recompute):
    model = _dense_stage()
    x = tf.constant(np.random.default_rng(3).normal(size=(4, 6)).astype("float32"))
    y = tf.constant(np.random.default_rng(4).normal(size=(4, 3)).astype("float32"))
    calls = []

    def metrics(yt, yp, sw):
        calls.append(1)  # traced once per signature; the update below runs per call
        model._compile_metrics.update_state(yt, yp, sw)

    runner = StageRunner(
        *_calls(model),
        metrics=metrics,
        recompute=recompute,
        state_variables=(),
    )
    model._compile_metrics.build(y, y)  # the trainer builds it before the first step
    for k in range(2):
        runner.forward(k, x, (y, None), scale=0.5)
    for k in range(2):
        runner.backward(k)
    if recompute:  # the backward replays the forward: the trainer updates metrics instead
        assert not runner.updates_metrics and not calls
        return
    assert runner.updates_metrics
    (count,) = [v for v in model._compile_metrics.variables if "count" in v.name]
    assert float(count.numpy()) == 2 * 4  # two forwards of 4 samples, none doubled


def test_bucketed_layout_round_trips_and_bounds_each_bucket():
    specs = [tf.TensorSpec((256, 256)), tf.TensorSpec((256,))] * 3 + [tf.TensorSpec((1024, 300))]
    layout = flat.BucketedLayout(specs, bucket_bytes=300 * 1024)
    largest = max(4 * int(np.prod(s.shape)) for s in specs)
    assert len(layout.buckets) > 1
    for bucket in layout.buckets:  # a bucket closes once full: at most one variable over
        assert 4 * bucket.length <= 300 * 1024 + largest + 64 * (len(bucket.slots) + 1)
    grads = [tf.random.normal(s.shape) for s in specs]
    packed = tf.function(layout.flatten)(grads, tf.constant(1.5))
    assert isinstance(packed, tuple) and len(packed) == len(layout.buckets)
    assert all(np.all(p.numpy()[-flat.TAIL :] == 1.5) for p in packed)  # each tail: data
    for got, want in zip(layout.unflatten_fn(packed), grads, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_fused_step_holds_its_gradients_about_once_not_twice():
    """The engine's own buffers must not grow back (docs/engine.md, "Memory"): a data-parallel
    step whose gradients are concatenated in chunks peaks at one copy of the gradients plus the
    chunks in flight, where one whole-model concat needs two copies. Measured in a process of its
    own (tests/support/allocator_peak.py), under TensorFlow's BFC allocator, whose peak counts the
    live bytes on any CPU (the default CPU allocator keeps statistics only where TensorFlow turns
    oneDNN on). How many chunks are in flight depends on how TensorFlow's threads interleave the
    concats: on an AMD EPYC with 2 cores, 6 runs in a row measured 1.25x (two 4 MiB chunks) four
    times and 1.37x (three) twice, and 2.12x whole every time (docs/testing.md). So the bound
    counts chunks, not a ratio: at most four in flight, and at least half a copy saved against
    the whole concat of the same run."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.allocator_peak"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, **POOLED_ALLOCATOR_ENV},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    peaks = json.loads(run.stdout.strip().splitlines()[-1])
    bucketed, whole = peaks["bucketed"], peaks["whole"]
    gradient_bytes, bucket_bytes = peaks["gradient_bytes"], peaks["bucket_bytes"]
    ratios = (bucketed / gradient_bytes, whole / gradient_bytes)
    assert whole > 1.8 * gradient_bytes, ratios  # the measurement sees the whole-model copy
    assert bucketed < gradient_bytes + 4 * bucket_bytes, ratios
    assert whole - bucketed > 0.5 * gradient_bytes, ratios


def test_compiled_metrics_built_inside_a_step_leave_it_traced_once():
    """Keras's compiled metrics build at their first update; built from inside a compiled step
    by `build_outside_the_trace`, their variables are not the step's, so TensorFlow does not
    trace the step again on its second call, and the metrics count as Keras's do."""
    model = _dense_stage()
    metrics = model._compile_metrics
    x = tf.constant(np.random.default_rng(3).normal(size=(4, 6)).astype("float32"))
    y = tf.constant(np.random.default_rng(4).normal(size=(4, 3)).astype("float32"))

    @tf.function
    def step(x, y):
        y_pred = model(x)
        if not metrics.built:
            build_outside_the_trace(metrics, y, y_pred)
        metrics.update_state(y, y_pred)

    step(x, y)
    step(x, y)
    assert step.experimental_get_tracing_count() == 1 and not step._created_variables
    want = keras.metrics.MeanAbsoluteError()
    want.update_state(y, model(x))
    want.update_state(y, model(x))
    np.testing.assert_allclose(metrics.result()["mae"], want.result(), rtol=1e-6)


class _Logged(_Values):
    """A `WeightSource` that logs each gather and prefetch by its segment's name."""

    def __init__(self, values, name, log):
        super().__init__(values)
        self.name, self.log = name, log

    def __call__(self):
        self.log.append(f"gather {self.name}")
        return super().__call__()

    def prefetch(self):
        self.log.append(f"prefetch {self.name}")


def test_a_segment_starts_the_next_gather_once_its_own_is_read_out():
    """ZeRO-3's prefetch through `SegmentedRunner`: forward, the next segment's gather starts
    as soon as the current one has its values (so it runs while that one computes, and no
    third segment's is in flight); backward, the earlier segment's, which recomputes, starts
    at once where the last segment reuses its forward's tape."""
    keras.utils.set_random_seed(3)
    first, second = keras.layers.Dense(4), keras.layers.Dense(2)
    first.build((None, 3))
    second.build((None, 4))
    log = []
    segments = []
    for j, (layer, loss) in enumerate([(first, None), (second, _mean_square)]):
        values = [tf.constant(v.numpy()) for v in layer.trainable_variables]
        segments.append(
            StageRunner(
                lambda inputs, training, layer=layer: layer(inputs),
                layer.trainable_variables,
                loss,
                recompute=True,
                gather=_Logged(values, f"s{j}", log),
                reuse_forward=j == 1,
                input_grads=j > 0,
            )
        )
    deferred.take_over([*first.trainable_variables, *second.trainable_variables], "gathered")
    deferred.let_go([*first.trainable_variables, *second.trainable_variables])
    runner = SegmentedRunner(segments, [*first.trainable_variables, *second.trainable_variables])
    x = tf.constant(np.ones((2, 3), "float32"))
    runner.forward(0, x, (tf.zeros((2, 2)), None))
    assert log == ["gather s0", "prefetch s1", "gather s1"]
    log.clear()
    runner.backward(0)
    assert log == ["prefetch s0", "gather s0"]  # s1 reused its tape, s0 recomputes
    assert segments[1].reused_forwards == 1


def _mean_square(y, y_pred, sample_weight):
    return tf.reduce_mean(tf.square(y - y_pred))
