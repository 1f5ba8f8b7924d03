"""Keras callbacks under hf.fit on a 2-stage pipeline, next to the same callbacks in Keras.

Argument: a folder shared by the ranks; file-writing callbacks get per-rank paths there, so the
test can see that only rank 0 wrote.
"""

import os

import keras
import numpy as np
from mpi4py import MPI

import hyparflow as hf
from tests.support.compare import relative_difference
from tests.support.fits import fit_in_order
from tests.support.models import compiled, data
from tests.support.report import args, report

STRATEGY = hf.Strategy("model", microbatches=2)


def regression(optimizer):
    """The MLP with a squared-error loss (cross-entropy clips NaN away; MSE keeps it)."""
    model = compiled("mlp", optimizer)
    model.compile(optimizer=model.optimizer, loss="mse")
    return model


def both(make_callbacks, epochs=4, x=None, y=None, optimizer="sgd", build=None):
    """Train the Keras reference and hf.fit with fresh callbacks from `make_callbacks(tag)`."""
    if x is None:
        x, y = data("mlp", n=48)
    build = build or (lambda: compiled("mlp", optimizer))
    reference = build()
    ref = reference.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=make_callbacks("keras"),
    )
    model = build()
    got = fit_in_order(model, x, y, 16, epochs, STRATEGY, callbacks=make_callbacks("hf"))
    return reference, ref, model, got


def early_stopping():
    reference, ref, model, got = both(
        lambda tag: [keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10)],
        epochs=6,
    )
    return {"epochs": len(got.epoch), "ref_epochs": len(ref.epoch)}


def checkpoint_and_csv(folder):
    rank = hf.rank()
    path = os.path.join(folder, f"checkpoint_rank{rank}.keras")
    csv = os.path.join(folder, f"log_rank{rank}.csv")
    tensorboard = os.path.join(folder, f"tensorboard_rank{rank}")
    x, y = data("mlp", n=48)
    model = compiled("mlp", "adam")
    history = hf.fit(
        model,
        x,
        y,
        batch_size=16,
        epochs=3,
        shuffle=False,
        verbose=0,
        strategy=STRATEGY,
        callbacks=[
            keras.callbacks.ModelCheckpoint(path),
            keras.callbacks.CSVLogger(csv),
            keras.callbacks.TensorBoard(tensorboard),
        ],
    )
    MPI.COMM_WORLD.Barrier()  # rank 0's files are complete before anyone looks
    result = {
        "checkpoint_exists": os.path.exists(path),
        "csv_exists": os.path.exists(csv),
        "tensorboard_exists": os.path.exists(tensorboard),
    }
    if rank == 0:
        saved = keras.saving.load_model(path)
        result["checkpoint_difference"] = relative_difference(
            saved.get_weights(), model.get_weights()
        )
        with open(csv) as f:
            rows = f.read().strip().splitlines()
        result["csv_rows"] = len(rows)
        losses = [float(r.split(",")[rows[0].split(",").index("loss")]) for r in rows[1:]]
        result["csv_loss_difference"] = float(
            np.max(np.abs(np.array(losses) - np.array(history.history["loss"])))
        )
    return result


def learning_rate_changes():
    def schedule(tag):
        return [keras.callbacks.LearningRateScheduler(lambda epoch: 0.1 * 0.5**epoch)]

    reference, _, model, _ = both(schedule)
    plateau = both(
        lambda tag: [
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10)
        ]
    )
    return {
        "learning_rate": float(model.optimizer.learning_rate),
        "ref_learning_rate": float(reference.optimizer.learning_rate),
        "weights": relative_difference(model.get_weights(), reference.get_weights()),
        "plateau_learning_rate": float(plateau[2].optimizer.learning_rate),
        "plateau_ref_learning_rate": float(plateau[0].optimizer.learning_rate),
        "plateau_weights": relative_difference(plateau[2].get_weights(), plateau[0].get_weights()),
    }


def terminate_on_nan():
    x, labels = data("mlp", n=64)
    y = keras.utils.to_categorical(labels, 3)
    y[40] = np.nan  # third batch of 16 (a NaN target: activations like ReLU can swallow NaN)
    batches = {"keras": [], "hf": []}

    def callbacks(tag):
        count = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: batches[tag].append(batch)
        )
        return [keras.callbacks.TerminateOnNaN(), count]

    _, ref, model, got = both(callbacks, epochs=3, x=x, y=y, build=lambda: regression("sgd"))
    return {
        "batches": batches["hf"],
        "ref_batches": batches["keras"],
        "stop_training": bool(model.stop_training),
        "epochs": len(got.epoch),
        "ref_epochs": len(ref.epoch),
    }


def batch_logs():
    """Each batch's logs, as a callback that reads them sees them (the loop shares them every
    batch), and the epoch logs of a run whose callbacks do not read them (shared once an
    epoch): both as Keras's."""
    seen = {"keras": [], "hf": []}

    def callbacks(tag):
        return [
            keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: seen[tag].append(float(logs["loss"]))
            )
        ]

    _, ref, _, got = both(callbacks, epochs=2)
    _, quiet_ref, _, quiet = both(lambda tag: [keras.callbacks.History()], epochs=2)
    return {
        "batches": seen["hf"],
        "ref_batches": seen["keras"],
        "history": [got.history["loss"], ref.history["loss"]],
        "quiet_history": [quiet.history["loss"], quiet_ref.history["loss"]],
    }


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    (folder,) = args()
    report(
        {
            "rank": hf.rank(),
            "early_stopping": early_stopping(),
            "files": checkpoint_and_csv(folder),
            "learning_rate": learning_rate_changes(),
            "terminate_on_nan": terminate_on_nan(),
            "batch_logs": batch_logs(),
        }
    )
