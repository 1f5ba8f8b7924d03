"""Keras callbacks under hf.fit (real mpirun, 2-stage pipeline) behave as in model.fit."""

import keras
import pytest

import hyparflow as hf
from hyparflow.engine.loops.epochs import needs_batch_logs
from tests.support.mpirun import run_scenario


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("callbacks")
    return run_scenario("callbacks_checks", 2, str(folder), timeout=300)


@pytest.mark.mpi
def test_early_stopping_stops_every_rank_at_keras_epoch(results):
    for r in results:
        assert r["early_stopping"]["epochs"] == r["early_stopping"]["ref_epochs"] < 6


@pytest.mark.mpi
def test_file_writers_write_once_on_rank_zero_with_the_full_model(results):
    zero, one = results
    assert zero["files"]["checkpoint_exists"] and zero["files"]["csv_exists"]
    assert zero["files"]["tensorboard_exists"]
    assert not any(one["files"][k] for k in ("checkpoint_exists", "csv_exists"))
    assert not one["files"]["tensorboard_exists"]
    assert zero["files"]["checkpoint_difference"] < 1e-6  # last epoch's save = trained model
    assert zero["files"]["csv_rows"] == 1 + 3
    assert zero["files"]["csv_loss_difference"] < 1e-6


@pytest.mark.mpi
def test_learning_rate_callbacks_change_every_stage(results):
    lrs = {r["rank"]: r["learning_rate"] for r in results}
    for r in results:
        lr = r["learning_rate"]
        assert lr["learning_rate"] == pytest.approx(lr["ref_learning_rate"])
        assert lr["learning_rate"] == pytest.approx(0.1 * 0.5**3)
        assert lr["weights"] < 1e-5
        assert lr["plateau_learning_rate"] == pytest.approx(lr["plateau_ref_learning_rate"])
        assert lr["plateau_learning_rate"] < 0.05  # it did reduce
        assert lr["plateau_weights"] < 1e-5
    assert lrs[0] == lrs[1]


@pytest.mark.mpi
def test_terminate_on_nan_stops_every_rank(results):
    for r in results:
        nan = r["terminate_on_nan"]
        assert nan["stop_training"]
        assert nan["batches"] == nan["ref_batches"] == [0, 1, 2]
        assert nan["epochs"] == nan["ref_epochs"] == 1


@pytest.mark.mpi
def test_batch_logs_reach_callbacks_every_batch_as_in_keras(results):
    for r in results:
        logs = r["batch_logs"]
        assert len(logs["batches"]) == len(logs["ref_batches"]) == 2 * 3
        assert logs["batches"] == pytest.approx(logs["ref_batches"], rel=1e-5)
        assert logs["history"][0] == pytest.approx(logs["history"][1], rel=1e-5)
        assert logs["quiet_history"][0] == pytest.approx(logs["quiet_history"][1], rel=1e-5)
    assert results[0]["batch_logs"]["batches"] == results[1]["batch_logs"]["batches"]


def test_only_callbacks_that_act_per_batch_need_each_batch_logs():
    def progbar(verbose):
        bar = keras.callbacks.ProgbarLogger()
        bar.set_params({"verbose": verbose, "epochs": 1, "steps": 1})
        return bar

    class Custom(keras.callbacks.Callback):
        def on_batch_end(self, batch, logs=None):
            pass

    quiet = [
        keras.callbacks.History(),
        keras.callbacks.EarlyStopping(),
        keras.callbacks.CSVLogger("x.csv"),
        keras.callbacks.ModelCheckpoint("x.keras"),
        keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: None),
        progbar(2),
        hf.callbacks.Checkpoint("ckpt", every_n_steps=10),
    ]
    acting = [
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.ModelCheckpoint("x.keras", save_freq=5),
        keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: None),
        progbar(1),
        Custom(),
        hf.callbacks.ScalingProfiler("logs"),  # keeps steps apart for its bubble
    ]
    assert [needs_batch_logs(cb) for cb in quiet] == [False] * len(quiet)
    assert [needs_batch_logs(cb) for cb in acting] == [True] * len(acting)
    declared = Custom()
    declared.needs_batch_logs = False
    assert not needs_batch_logs(declared)
