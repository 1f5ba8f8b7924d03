"""Files saved after a split run continue in one plain Keras process as if never split.

A scenario calls `train_and_save(folder, strategy)` on every rank: hf.fit trains a small Adam
model, rank 0 writes it with `model.save` and with `hf.export` (from an hf.callbacks.Checkpoint).
After its MPI work, rank 0 calls `continue_saved_files`: it loads each file, fits on, and
compares with plain Keras trained as long in the same process.
"""

import os
import warnings

import keras
import numpy as np

import hyparflow as hf
from tests.support.compare import relative_difference
from tests.support.fits import fit_in_order
from tests.support.models import FEATURES, data

BATCH, SAMPLES = 16, 64  # 4 steps an epoch
EPOCHS_BEFORE, EPOCHS_AFTER = 2, 1
SKIPPED = "Skipping variable loading for optimizer"
FILES = {"save": "saved.keras", "export": "exported.keras"}  # what wrote it -> file name


def _model():
    keras.utils.set_random_seed(11)
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(8, activation="relu")(inputs)
    x = keras.layers.Dense(8, activation="tanh")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return model


def _fit(model, epochs):
    x, y = data("mlp", n=SAMPLES)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)


def _difference(got, expected) -> float:
    if len(got) != len(expected):
        return float("inf")
    return relative_difference(got, expected)


def _load_and_continue(path, ref_optimizer, reference) -> dict:
    """Load `path` in this process, note Keras's warnings, fit on and compare."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = keras.saving.load_model(path)
        except ValueError as error:  # a file Keras cannot load (e.g. slots of shard shapes)
            return {"error": str(error)[:300]}
    optimizer = [np.asarray(v.numpy()) for v in loaded.optimizer.variables]
    _fit(loaded, EPOCHS_AFTER)
    return {
        "skipped": [str(w.message) for w in caught if SKIPPED in str(w.message)],
        "optimizer": _difference(optimizer, ref_optimizer),
        "continued": _difference(loaded.get_weights(), reference.get_weights()),
    }


def train_and_save(folder: str, strategy) -> None:
    """Collective: train with `strategy` for 8 steps; rank 0 writes `saved.keras` with
    `model.save` and `exported.keras` with `hf.export` (from the run's checkpoint)."""
    os.makedirs(folder, exist_ok=True)
    checkpoints = os.path.join(folder, "checkpoints")
    x, y = data("mlp", n=SAMPLES)
    model = _model()
    fit_in_order(
        model,
        x,
        y,
        BATCH,
        EPOCHS_BEFORE,
        strategy,
        callbacks=[hf.callbacks.Checkpoint(checkpoints)],
    )
    if hf.rank() == 0:
        model.save(os.path.join(folder, FILES["save"]))
        hf.export(checkpoints, os.path.join(folder, FILES["export"]))


def continue_saved_files(folders: dict) -> dict:
    """In this process alone (after the MPI work, so no rank waits in a barrier meanwhile):
    load each folder's two files, fit 4 more steps, compare with 12 steps of plain Keras.
    `folders`: layout name -> folder of `train_and_save`."""
    reference = _model()
    _fit(reference, EPOCHS_BEFORE)
    ref_optimizer = [np.asarray(v.numpy()) for v in reference.optimizer.variables]
    _fit(reference, EPOCHS_AFTER)
    return {
        layout: {
            name: _load_and_continue(os.path.join(folder, file), ref_optimizer, reference)
            for name, file in FILES.items()
        }
        for layout, folder in folders.items()
    }
