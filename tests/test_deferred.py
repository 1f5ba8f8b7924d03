"""Models bigger than one rank: `hf.scope()` builds without allocating, hf.fit gives each rank
only its share (trained exactly as Keras trains the whole), other weights fail clearly, and
checkpoints and `hf.export` never gather the model on one rank.

The scope's behaviour runs in this process; training runs under a real `mpirun`
(tests/mpi/deferred_checks.py: four pipeline stages, two stages x two tensor ranks, a
checkpoint exported and resumed as four replicas, each compared with Keras's own fit; most
compiled inside the scope with the optimizer made there, as a strategy.scope() user does).
"""

import json
import os
import subprocess
import sys
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
from hyparflow import deferred
from hyparflow.checkpoint.reader import LazyState
from hyparflow.checkpoint.state import cut_shard, join_shards, shard_key, slice_key
from hyparflow.engine.stages import agreed_plan
from hyparflow.memory import one_process
from hyparflow.memory.resident import PeakGrowth
from tests.support.mpirun import run_scenario

TOLERANCE = 1e-5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _small(with_dropout=True):
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu")(inputs)
    if with_dropout:
        x = keras.layers.Dropout(0.2)(x)
    x = keras.layers.BatchNormalization()(x)
    tokens = keras.Input((3,), dtype="int32")
    table = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(tokens))
    x = keras.layers.Concatenate()([x, table])
    return keras.Model([inputs, tokens], keras.layers.Dense(4)(x))


def _seeded(builder, seed=11):
    keras.utils.set_random_seed(seed)
    return builder()


def test_a_four_billion_parameter_model_builds_without_memory():
    optimizer = keras.optimizers.Adam()
    with PeakGrowth() as growth, hf.scope():
        inputs = keras.Input((16384,))
        x = inputs
        for _ in range(15):
            x = keras.layers.Dense(16384, activation="relu")(x)
        model = keras.Model(inputs, keras.layers.Dense(10)(x))
        model.compile(optimizer, "mse")
    assert model.count_params() > 4.0e9  # 16 GB of float32 weights, 48 GB with Adam's
    assert growth.mib < 200, growth.mib
    assert all(deferred.is_deferred(v) for v in model.weights)


def test_initial_values_equal_an_ordinary_build_and_training_matches_keras():
    reference = _seeded(_small)
    with hf.scope():
        model = _seeded(_small)
    assert deferred.any_deferred(model)
    # computed, not assigned
    for v, expected in zip(model.weights, reference.get_weights(), strict=True):
        assert np.array_equal(np.asarray(deferred.initial_value(v)), expected)
    data = [np.ones((8, 16), "float32"), np.arange(24).reshape(8, 3) % 20], np.ones((8, 4))
    for m in (reference, model):
        m.compile(keras.optimizers.Adam(0.01), "mse")
    hf.fit(model, *data, epochs=2, verbose=0)  # one process: all of it is materialised
    reference.fit(*data, epochs=2, verbose=0)
    assert not deferred.any_deferred(model)
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=1e-7)


def test_reading_a_weight_that_is_not_held_fails_and_symbolic_use_works():
    with hf.scope():
        model = _seeded(_small)
    with pytest.raises(hf.NotHeldError, match=r"dense.*/kernel is not held.*hf.export"):
        model.layers[1].kernel.numpy()
    with pytest.raises(hf.NotHeldError):
        model.get_weights()
    features = keras.Model(model.inputs, model.layers[1].output)  # graphs need only shapes
    assert features.output.shape == (None, 32)
    assert deferred.materialize(model.weights[:2]) == 2
    assert model.weights[0].numpy().shape == (16, 32)


def _compiled_inside(optimizer, policy):
    """_small built and compiled as a strategy.scope() user does: the optimizer made inside,
    and with it a metric object (as keras_hub's compile makes), whose variables are made in
    compile() but reached through `model.metrics` only once the first step builds them."""
    keras.mixed_precision.set_global_policy(policy)
    objects = optimizer == "object"
    metrics = (lambda: [keras.metrics.MeanAbsoluteError()]) if objects else (lambda: ["mae"])
    try:
        with hf.scope():
            model = _seeded(_small)
            made = keras.optimizers.Adam(1e-3) if objects else optimizer
            model.compile(optimizer=made, loss="mse", metrics=metrics())
        reference = _seeded(_small)
        reference.compile(optimizer="adam", loss="mse", metrics=metrics())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, reference


@pytest.mark.parametrize(
    "optimizer, policy",
    [("adam", "float32"), ("object", "mixed_float16")],  # + loss scaling
)
def test_building_and_compiling_inside_the_scope_trains_as_keras(optimizer, policy):
    model, reference = _compiled_inside(optimizer, policy)
    assert all(deferred.is_deferred(v) for v in model.weights)  # the weights: deferred
    step, rate = model.optimizer.iterations, model.optimizer.learning_rate  # made from values
    assert int(step.numpy()) == 0 and float(rate.numpy()) == pytest.approx(1e-3)
    assert not any(deferred.is_deferred(v) for v in model.optimizer.variables)
    assert (model.jit_compile, model.steps_per_execution) == (
        reference.jit_compile,
        reference.steps_per_execution,
    )
    data = [np.ones((8, 16), "float32"), np.arange(24).reshape(8, 3) % 20], np.ones((8, 4))
    history = hf.fit(model, *data, batch_size=4, epochs=2, verbose=0)
    expected = reference.fit(*data, batch_size=4, epochs=2, verbose=0)
    assert not deferred.any_deferred(model)
    assert int(step.numpy()) == int(reference.optimizer.iterations.numpy()) > 0
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=1e-7)
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=TOLERANCE)


def test_values_inside_the_scope_are_created_or_deferred_and_assignments_refused():
    init = keras.Variable.__init__
    with hf.scope():
        counter = keras.Variable(5, trainable=False)  # small state: created with its value
        weight = keras.Variable(np.full((2, 3), 0.5))  # a weight: deferred like the others
    assert int(counter.numpy()) == 5 and deferred.is_deferred(weight)
    assert (weight.shape, weight.dtype) == ((2, 3), "float64")  # as keras.Variable makes it
    with pytest.raises(hf.NotHeldError):
        weight.numpy()
    assert deferred.materialize([weight]) == 1 and np.all(weight.numpy() == 0.5)
    assert keras.Variable.__init__ is init  # the scope's hook is gone once it closes
    weights = _seeded(_small).get_weights()
    with pytest.raises(ValueError, match=r"assigned inside hf.scope\(\)"), hf.scope():
        _seeded(_small).set_weights(weights)
    with pytest.raises(ValueError, match=r"assigned inside hf.scope\(\)"), hf.scope():
        keras.optimizers.SGD().learning_rate = 0.5  # a variable made inside, then assigned
    assert keras.Variable.__init__ is init
    with pytest.raises(RuntimeError), hf.scope():  # an error inside: the hook goes too
        raise RuntimeError
    assert keras.Variable.__init__ is init
    with hf.scope(), hf.scope():  # nested: counted, removed by the outer one only
        assert keras.Variable.__init__ is not init
    assert keras.Variable.__init__ is init


def test_balance_by_time_needs_weights_and_is_refused():
    with hf.scope():
        model = _seeded(_small)
    with pytest.raises(ValueError, match=r"balance='time'.*balance='layers'"):
        agreed_plan._check_timeable(model)


def test_checkpoints_are_read_lazily_with_pieces_joined():
    whole = np.arange(24.0).reshape(4, 6)
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for t in range(3):
            paths.append(f"{folder}/stage-0-shard-{t}.npz")
            entries = {shard_key("w/1", t, 3, 1): cut_shard(whole, t, 3, 1)}
            flat = cut_shard(whole, t, 3, 1).ravel()  # a tensor piece's slot in two ZeRO ranges
            for start, stop in ((0, 3), (3, 8)):
                key = slice_key(shard_key("opt/1/m", t, 3, 1), start, stop, (4, 2))
                entries[key] = flat[start:stop]
            if t == 0:
                entries["w/0"] = np.ones(3)
            np.savez(paths[-1], **entries)
        state = LazyState(paths)
        assert sorted(state) == ["opt/1/m", "w/0", "w/1"]
        assert "w/1" in state and "w/2" not in state
        assert np.array_equal(state["w/1"], whole) and np.array_equal(state["opt/1/m"], whole)
        dense = {k: v for p in paths for k, v in np.load(p).items()}
        assert np.array_equal(join_shards(dense)["w/1"], state["w/1"])
        state.close()


@pytest.fixture(scope="module")
def four_ranks():
    with tempfile.TemporaryDirectory() as folder:
        yield run_scenario("deferred_checks", 4, folder, timeout=400)


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["P4", "P2T2", "P2R2-zero", "P2R2-interleaved"])
def test_each_rank_holds_and_trains_only_its_share(four_ranks, layout):
    results = [r[layout] for r in four_ranks]
    held = [set(r["held"]) for r in results]
    count = results[0]["count"]
    if layout == "P4":  # four stages: each weight held by exactly one rank
        assert sorted(i for h in held for i in h) == list(range(count))
    elif layout.startswith("P2R2"):  # replicas of a stage hold the same weights
        assert held[0] == held[2] and held[1] == held[3] and not held[0] & held[1]
        assert held[0] | held[1] == set(range(count))
    else:  # tensor ranks of a stage hold the same whole weights; the split ones by no one
        assert held[0] == held[1] and held[2] == held[3] and not held[0] & held[2]
        assert all(r["split"] > 0 for r in results) and len(held[0] | held[2]) < count
    for r in results:
        assert r["weights"] < TOLERANCE and r["shards"] < TOLERANCE
        assert r["history"] < TOLERANCE
        assert r["steps"][0] == r["steps"][1]  # the step counter, made inside for P4 and P2T2
        assert "is not held by this process" in r["refused"] and "hf.export" in r["refused"]
    if layout == "P4":
        assert max(r["predict"] for r in results) < TOLERANCE
        # every rank lacks some weight of the whole model: all refuse, none trains from scratch
        for r in results:
            assert "never held" in r["relayout"] and "resume_from" in r["relayout"]


@pytest.mark.mpi
def test_a_deferred_checkpoint_exports_and_resumes_exactly(four_ranks):
    assert four_ranks[0]["export"] < TOLERANCE  # one .keras file, written weight by weight
    assert max(r["resumed"] for r in four_ranks) < TOLERANCE  # P2xT2 -> four replicas
    assert all(r["resumed_steps"][0] == r["resumed_steps"][1] for r in four_ranks)


def _python(*arguments) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.mpi.export_memory", *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_export_holds_one_weight_at_a_time(tmp_path):
    folder, path = str(tmp_path / "ckpt"), str(tmp_path / "model.keras")
    model_bytes = _python("train", folder)["bytes"]
    growth = _python("export", folder, path)["growth"]
    # 8 kernels of 64 MiB: 512 MiB whole (twice that when assigned, then saved by Keras, which
    # buffers the weights file in memory); a weight at a time measured ~200 MiB (0.39x)
    assert growth < 0.5 * model_bytes, (growth / 2**20, model_bytes / 2**20)
    exported = keras.saving.load_model(path)
    assert np.array_equal(exported.weights[-2].numpy(), np.load(folder + "/last_kernel.npy"))


def test_one_process_refuses_what_its_memory_limit_cannot_hold(monkeypatch):
    optimizer = keras.optimizers.Adam()
    with hf.scope():
        model = _seeded(lambda: keras.Sequential([keras.Input((512,)), keras.layers.Dense(512)]))
    model.compile(optimizer, "mse")
    monkeypatch.setattr(one_process, "memory_room", lambda: 2**20)  # 1 MiB left under the limit
    with pytest.raises(MemoryError, match=r"needs about .* GiB more \(hf.memory_plan\)"):
        hf.fit(model, np.ones((4, 512)), np.ones((4, 512)), verbose=0)
    assert deferred.any_deferred(model)  # nothing was allocated
    monkeypatch.setattr(one_process, "memory_room", lambda: None)  # no limit: it trains
    hf.fit(model, np.ones((4, 512)), np.ones((4, 512)), verbose=0)


def test_a_variable_taken_over_is_emptied_and_filled_in_one_backing():
    """ZeRO-3 (deferred.take_over): a variable let go frees its value and raises on an eager
    read; a step traced before keeps working after it is filled again, reading the new value
    (the backing is the same resource), and Keras's layers see its static shape."""
    layer = keras.layers.Dense(2, kernel_initializer="ones", use_bias=False)
    x = tf.ones((1, 3))
    layer(x)
    kernel = layer.kernel
    deferred.take_over([kernel], "kept by the test")
    step = tf.function(lambda: layer(x))
    np.testing.assert_allclose(step().numpy(), [[3.0, 3.0]])
    deferred.let_go([kernel])
    assert deferred.is_let_go(kernel)
    with pytest.raises(hf.NotHeldError, match="kernel is not held now: kept by the test"):
        kernel.numpy()
    deferred.hold(kernel, np.full((3, 2), 2.0, "float32"))
    assert not deferred.is_let_go(kernel)
    np.testing.assert_allclose(step().numpy(), [[6.0, 6.0]])  # the same trace, the new value

    @tf.function
    def filled_for_one_call(value):
        kernel.assign(value)
        out = layer(x)
        deferred.let_go([kernel])  # inside the trace too
        return out

    np.testing.assert_allclose(filled_for_one_call(tf.ones((3, 2))).numpy(), [[3.0, 3.0]])
    assert deferred.is_let_go(kernel)
