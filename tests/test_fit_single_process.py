"""hf.fit on one process is model.fit: same final weights and the same History."""

import os
import subprocess
import sys
import textwrap

import h5py
import keras
import numpy as np
import pytest

import hyparflow as hf
from tests.support.mpirun import MPI_ENV


def _model():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer="l2")(inputs)
    hidden = keras.layers.Dropout(0.2)(hidden)
    outputs = keras.layers.Dense(3, activation="softmax")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(100, 6)).astype("float32")
    y = rng.integers(0, 3, size=100)
    w = rng.uniform(0.5, 1.5, size=100).astype("float32")
    return x, y, w


def _train(fit, **kwargs):
    keras.utils.set_random_seed(7)
    model = _model()
    x, y, w = _data()
    keras.utils.set_random_seed(11)  # same shuffling and dropout masks for both runs
    history = fit(model, x, y, **kwargs, sample_weight=w)
    return model.get_weights(), history


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(batch_size=16, epochs=3, shuffle=True, validation_split=0.2),
        dict(batch_size=32, epochs=4, initial_epoch=1, shuffle=False, steps_per_epoch=2),
    ],
    ids=["shuffle-validation", "initial-epoch-steps"],
)
def test_hf_fit_equals_model_fit(kwargs):
    args = dict(kwargs, verbose=0)
    ref_weights, ref_history = _train(lambda m, x, y, **kw: m.fit(x, y, **kw), **args)
    hf_weights, hf_history = _train(hf.fit, **args)
    assert isinstance(hf_history, keras.callbacks.History)
    assert len(ref_weights) == len(hf_weights)
    # bitwise by construction: in one process hf.fit calls model.fit with the same arguments
    for ref, got in zip(ref_weights, hf_weights, strict=True):
        np.testing.assert_array_equal(got, ref)
    assert hf_history.history.keys() == ref_history.history.keys()
    for key, values in ref_history.history.items():
        np.testing.assert_allclose(hf_history.history[key], values, rtol=0, atol=0)
    assert hf_history.epoch == ref_history.epoch


def test_hf_fit_runs_callbacks_and_validation_data():
    seen = []
    x, y, _ = _data()
    keras.utils.set_random_seed(3)
    model = _model()
    history = hf.fit(
        model,
        x,
        y,
        batch_size=25,
        epochs=2,
        verbose=0,
        validation_data=(x[:20], y[:20]),
        callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(e))],
    )
    assert seen == [0, 1]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history.history)


def test_uncompiled_model_is_a_clear_error():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="model.compile"):
        hf.fit(model, np.zeros((4, 3)), np.zeros((4, 1)))


def test_rank_and_size_without_launcher():
    assert hf.rank() == 0
    assert hf.size() == 1


def test_hf_fit_reads_hdf5_on_one_process_like_arrays(tmp_path):
    x, y, _ = _data()
    path = str(tmp_path / "train.h5")
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y
    keras.utils.set_random_seed(7)
    model = _model()
    model.layers[2].rate = 0.0  # same math without dropout masks
    keras.utils.set_random_seed(7)
    reference = _model()
    reference.layers[2].rate = 0.0
    reference.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    with hf.data.HDF5(path, x="x", y="y") as data:
        hf.fit(model, data, batch_size=20, epochs=2, shuffle=False, verbose=0)
        evaluated = hf.evaluate(model, data, batch_size=20, verbose=0)
    for ref, got in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    assert np.isfinite(evaluated).all()


@pytest.mark.mpi
def test_one_process_does_not_start_mpi_so_mpirun_from_it_works():
    """A process that started MPI as a singleton breaks any mpirun it launches; hf.fit on one
    process must therefore never start MPI (checked in a clean child interpreter)."""
    script = textwrap.dedent(
        """
        import subprocess, sys
        import keras, numpy as np
        import hyparflow as hf
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        hf.fit(model, np.zeros((8, 3)), np.zeros((8, 1)), verbose=0)
        assert hf.rank() == 0 and hf.size() == 1
        assert "mpi4py.MPI" not in sys.modules or not sys.modules["mpi4py.MPI"].Is_initialized()
        out = subprocess.run(
            ["mpirun", "-np", "2", "--oversubscribe", sys.executable, "-c",
             # One write per rank: under PYTHONUNBUFFERED, print's two writes ("2", then
             # the newline) of two ranks can interleave into "22\\n\\n".
             "import sys; from mpi4py import MPI; "
             "sys.stdout.write(f'{MPI.COMM_WORLD.Get_size()}\\\\n')"],
            capture_output=True, text=True,
        )
        assert out.returncode == 0 and out.stdout.split() == ["2", "2"], out
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX"))}
    result = subprocess.run(
        [sys.executable, "-c", script], env={**env, **MPI_ENV}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("verbose", [2, 0])
def test_rank_0_says_that_mixture_blocks_run_sparsely_unless_silenced(verbose, capsys):
    """The layout the user did not name (issue 64: nothing said that the experts ran
    sparsely): one line, unless `verbose=0`; a Strategy that computes them densely says none."""
    from hyparflow.model_checks import layout_notice
    from tests.support import zoo

    model = zoo.compiled("mixtral", "sgd")
    hf.fit(model, zoo.text_batches("mixtral", 8).take(1), epochs=1, verbose=verbose)
    said = [line for line in capsys.readouterr().out.splitlines() if "mixture-of-experts" in line]
    assert said == ([] if verbose == 0 else [layout_notice(model, hf.Strategy("data"))])
    assert "computed sparsely" in layout_notice(model, hf.Strategy("data"))
    assert "2 groups of replicas (experts=2)" in layout_notice(model, hf.Strategy(experts=2))
    assert layout_notice(model, hf.Strategy(sparse_experts=False)) is None
