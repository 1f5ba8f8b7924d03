"""Keras callbacks under hf.fit (real mpirun, 2-stage pipeline) behave as in model.fit."""

import pytest

from tests.mpirun import run_scenario


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("callbacks")
    return run_scenario("callbacks_checks", 2, str(folder), timeout=300)


def test_early_stopping_stops_every_rank_at_keras_epoch(results):
    for r in results:
        assert r["early_stopping"]["epochs"] == r["early_stopping"]["ref_epochs"] < 6


def test_file_writers_write_once_on_rank_zero_with_the_full_model(results):
    zero, one = results
    assert zero["files"]["checkpoint_exists"] and zero["files"]["csv_exists"]
    assert zero["files"]["tensorboard_exists"]
    assert not any(one["files"][k] for k in ("checkpoint_exists", "csv_exists"))
    assert not one["files"]["tensorboard_exists"]
    assert zero["files"]["checkpoint_difference"] < 1e-6  # last epoch's save = trained model
    assert zero["files"]["csv_rows"] == 1 + 3
    assert zero["files"]["csv_loss_difference"] < 1e-6


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


def test_terminate_on_nan_stops_every_rank(results):
    for r in results:
        nan = r["terminate_on_nan"]
        assert nan["stop_training"]
        assert nan["batches"] == nan["ref_batches"] == [0, 1, 2]
        assert nan["epochs"] == nan["ref_epochs"] == 1
