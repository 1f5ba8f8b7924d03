"""The Keras callbacks' state a checkpoint holds: captured as JSON, set back after Keras's
on_train_begin reset it, matched by class and place; a resume that would need EarlyStopping's
unsaved best weights is refused (in milliseconds, no MPI: the resumed run is test_reliability's)."""

import json
import math

import keras
import numpy as np
import pytest

from hyparflow.checkpoint.callback_state import capture, check_resumable, restore


def _trained_callbacks():
    history = keras.callbacks.History()
    first = keras.callbacks.EarlyStopping(monitor="loss", patience=5)
    second = keras.callbacks.EarlyStopping(monitor="val_loss", patience=5)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=3)
    callbacks = [history, first, keras.callbacks.TerminateOnNaN(), second, plateau]
    for callback in callbacks:
        callback.on_train_begin()
    history.epoch, history.history = [0, 1], {"loss": [np.float32(0.5), 0.25], "acc": [0.1, 0.2]}
    first.wait, first.best, first.best_epoch = np.int64(1), np.float32(0.25), 1
    second.wait, second.best = 2, math.inf
    plateau.wait, plateau.cooldown_counter, plateau.best = 1, 0, 0.125
    return callbacks


def test_the_state_goes_through_json_and_back_into_fresh_callbacks():
    held = json.loads(json.dumps(capture(_trained_callbacks())))
    fresh = _trained_callbacks()
    for callback in fresh:
        callback.on_train_begin()  # what the resumed fit does first
    restore(fresh, held)
    history, first, _, second, plateau = fresh
    assert (history.epoch, history.history) == ([0, 1], {"loss": [0.5, 0.25], "acc": [0.1, 0.2]})
    assert (first.wait, first.best, first.best_epoch) == (1, 0.25, 1)
    assert (second.wait, second.best) == (2, math.inf)  # matched by place among its class
    assert (plateau.wait, plateau.best) == (1, 0.125)
    history.history["loss"].append(0.2)  # the next epoch's, as History.on_epoch_end adds it
    assert held[0]["state"]["history"]["loss"] == [0.5, 0.25]  # restored as a copy


def test_callbacks_the_checkpoint_has_no_state_for_stay_fresh():
    held = capture(_trained_callbacks()[:2])  # History and the first EarlyStopping only
    later = keras.callbacks.EarlyStopping(monitor="loss")
    later.on_train_begin()
    restore([keras.callbacks.History(), keras.callbacks.EarlyStopping(), later], held)
    assert (later.wait, later.best) == (0, None)


@pytest.mark.parametrize(
    "restores, best, refused",
    [
        (True, 0.5, True),  # the best weights of epoch 2 were in memory only
        (False, 0.5, False),  # no weights to restore
        (True, None, False),  # resumed inside the first epoch: no best yet
    ],
)
def test_a_resume_that_needs_unsaved_best_weights_is_refused(restores, best, refused):
    stop = keras.callbacks.EarlyStopping(monitor="loss", restore_best_weights=restores)
    stop.on_train_begin()
    stop.best, stop.best_epoch = best, 1
    held = capture([stop])
    if refused:
        with pytest.raises(ValueError, match="found its best loss in epoch 2, before the"):
            check_resumable([stop], held, resumed_epoch=2)
    else:
        check_resumable([stop], held, resumed_epoch=2)
