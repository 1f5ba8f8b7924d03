"""Checkpoints, resume, crashes and stalls under a real mpirun.

Usage: `python -m tests.mpi.reliability OUT MODE FOLDER` with MODE one of
  crash        train with checkpoints; rank 1 kills itself (SIGKILL) in the middle of epoch 2
  resume       resume that run with resume=True; also train the same run uninterrupted; then
               save and export a P=2 and a T=2 run and continue each file in one process
  torn_save    rank 0 is killed during the second checkpoint save, before its manifest
  after_torn   resume from the folder the torn save left
  reshape      checkpoint a 2x2 hybrid run, resume it as 4x1, 1x4 and 2x2; export it
  tensor_reshape  checkpoint a 2-stage run split over 2 tensor ranks; resume it with T = 2, 1
               (2 stages x 2 replicas; 4 replicas) and 4; export it
  expert_reshape  checkpoint a Mixtral whose experts split over 2 replicas; resume it with
               experts = 2 and 1 and as a 2-stage pipeline; export it; count held elements
  stall        rank 1 stops answering; the watchdog must end the job
"""

import contextlib
import io
import os
import signal
import time

import keras
import numpy as np
from mpi4py import MPI

import hyparflow as hf
from hyparflow import deferred
from hyparflow.checkpoint import manifest
from hyparflow.moe import expert_weights
from tests.support import zoo
from tests.support.compare import relative_difference
from tests.support.models import data, seeded_build
from tests.support.report import args, report
from tests.support.saved_files import continue_saved_files, train_and_save

EPOCHS, BATCH = 3, 16


def model_with_dropout(dropout=0.3):
    """Dropout makes exact resume depend on restored random state; its masks depend on the
    micro-batch shapes, so runs with another partitioning use dropout=0."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu")(inputs)
    x = keras.layers.Dropout(dropout)(x)
    x = keras.layers.Dense(8, activation="tanh")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def stateful_callbacks():
    """Keras callbacks whose counters a resume must restore: with min_delta=10 the loss never
    improves after epoch 1, so ReduceLROnPlateau halves the rate at the end of epoch 2 (which
    changes the weights) only if it remembers epoch 1, and EarlyStopping counts 2 epochs of
    patience by the end only if it does."""
    return [
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=10),
        keras.callbacks.EarlyStopping(monitor="loss", patience=5, min_delta=10),
    ]


def train(folder, callbacks=(), strategy="model", epochs=EPOCHS, dropout=0.3, verbose=0, **kwargs):
    x, y = data("mlp", n=64)
    model = model_with_dropout(dropout)
    np.random.seed(123)  # rank 0 draws the shuffle seed from numpy: same seed in every run
    stateful = stateful_callbacks()
    history = hf.fit(
        model,
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=True,
        verbose=verbose,
        callbacks=[hf.callbacks.Checkpoint(folder, every_n_steps=2), *callbacks, *stateful],
        strategy=strategy,
        watchdog_timeout=30,
        **kwargs,
    )
    history.stateful = {type(cb).__name__: (cb.wait, cb.best) for cb in stateful}
    return model, history


class KillRank(keras.callbacks.Callback):
    """SIGKILL one rank after a given global batch (a node dying mid-training)."""

    def __init__(self, rank, after_batches):
        super().__init__()
        self.rank, self.after, self.seen = rank, after_batches, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.after and hf.rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class TornCheckpoint(hf.callbacks.Checkpoint):
    """Rank 0 dies while completing the second save: stage files written, manifest not."""

    saves = 0

    def _complete(self, folder, manifest):
        TornCheckpoint.saves += 1
        if TornCheckpoint.saves == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._complete(folder, manifest)


def _resume_each(folder, strategies: dict):
    """Resume `folder`'s latest checkpoint under each strategy (name -> trained weights), then
    export it (the loaded .keras model)."""
    results = {}
    for name, strategy in strategies.items():
        x, y = data("mlp", n=64)
        model = model_with_dropout(0.0)
        hf.fit(
            model,
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=True,
            verbose=0,
            strategy=strategy,
            resume_from=folder,
        )
        results[name] = model.get_weights()
    exported = os.path.join(folder, "exported.keras")
    if hf.rank() == 0:
        hf.export(folder, exported)
    MPI.COMM_WORLD.Barrier()
    return results, keras.saving.load_model(exported)


def crash(folder):
    """Train with checkpoints; rank 1 kills itself in the middle of epoch 2."""
    train(folder, callbacks=[KillRank(1, after_batches=7)])  # 4 batches per epoch
    report({"finished": True})  # must never happen


def resume(folder):
    """Resume the crashed run, train it uninterrupted, and continue saved P=2 and T=2 files."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # progress bars, and the line saying it resumes
        resumed, history = train(folder, resume=True, verbose=2)
    reference, ref_history = train(folder + "-uninterrupted")
    saved = {"P2": f"{folder}-saved-P2", "T2": f"{folder}-saved-T2"}
    train_and_save(saved["P2"], hf.Strategy("model", partitions=2))
    train_and_save(saved["T2"], hf.Strategy("data", tensor=2))
    report(
        {
            # rank 0 alone, after the MPI work: no rank waits for it in a barrier
            "saved_files": continue_saved_files(saved) if hf.rank() == 0 else None,
            "rank": hf.rank(),
            "weights": relative_difference(resumed.get_weights(), reference.get_weights()),
            "bitwise": all(
                np.array_equal(a, b)
                for a, b in zip(resumed.get_weights(), reference.get_weights(), strict=True)
            ),
            "resume_lines": [
                line for line in printed.getvalue().splitlines() if "resuming from" in line
            ],
            "epochs": (history.epoch, ref_history.epoch),
            "history": history.history,
            "ref_history": ref_history.history,
            "stateful": (history.stateful, ref_history.stateful),
            "refused": _refused_without_best_weights(folder),
        }
    )


def _fit_dropout_mlp(callbacks: list, **options):
    """hf.fit of a fresh two-stage dropout MLP for EPOCHS epochs with `callbacks`; `options`:
    hf.fit's others (resume_from, watchdog_timeout)."""
    x, y = data("mlp", n=64)
    fit = dict(batch_size=BATCH, epochs=EPOCHS, verbose=0, strategy="model", callbacks=callbacks)
    return hf.fit(model_with_dropout(), x, y, **fit, **options)


def _refused_without_best_weights(folder) -> str:
    """What resuming with EarlyStopping(restore_best_weights=True) says: the best weights of an
    epoch before the checkpoint were never saved."""
    early = keras.callbacks.EarlyStopping(monitor="loss", restore_best_weights=True)
    try:
        _fit_dropout_mlp([early], resume_from=folder)
    except ValueError as error:
        return str(error)
    return "not refused"


def torn_save(folder):
    """Rank 0 is killed during the second checkpoint save, before its manifest."""
    torn = TornCheckpoint(folder, every_n_steps=2, every_epoch=False)
    _fit_dropout_mlp([torn], watchdog_timeout=30)
    report({"finished": True})  # must never happen


def after_torn(folder):
    """Resume from the folder the torn save left."""
    found = [step for step, _ in manifest.complete_checkpoints(folder)]
    partial = sorted(n for n in os.listdir(folder) if n.startswith("ckpt-"))
    model, history = train(folder, resume=True)
    report({"rank": hf.rank(), "complete": found, "folders": partial, "epochs": history.epoch})


def reshape(folder):
    """Checkpoint a 2x2 hybrid run, resume it as 4x1, 1x4, 2x2 and 2x2 interleaved (each rank
    two chunks of the model's four layers); export it."""
    first, _ = train(
        folder, strategy=hf.Strategy("hybrid", partitions=2, replicas=2), epochs=2, dropout=0.0
    )
    results, exported = _resume_each(
        folder,
        {
            "same": hf.Strategy("hybrid", partitions=2, replicas=2),
            "model4": hf.Strategy("model", partitions=4),
            "data4": hf.Strategy("data"),
            "interleaved": hf.Strategy("hybrid", partitions=2, replicas=2, schedule="interleaved"),
        },
    )
    report(
        {
            "rank": hf.rank(),
            "model4": relative_difference(results["model4"], results["same"]),
            "data4": relative_difference(results["data4"], results["same"]),
            "interleaved": relative_difference(results["interleaved"], results["same"]),
            "export": relative_difference(exported.get_weights(), first.get_weights()),
            "export_compiled": exported.compiled and exported.optimizer.__class__.__name__,
        }
    )


def tensor_reshape(folder):
    """Checkpoint a 2-stage run split over 2 tensor ranks; resume it with T = 2, 1 and 4."""
    strategies = {
        "same": hf.Strategy("model", partitions=2, tensor=2),
        "tensor1": hf.Strategy("hybrid", partitions=2, replicas=2),
        "data4": hf.Strategy("data"),
        "tensor4": hf.Strategy("data", tensor=4),
    }
    first, _ = train(folder, strategy=strategies["same"], epochs=2, dropout=0.0)
    shard_files = sorted(n for n in os.listdir(manifest.latest(folder)) if n.endswith(".npz"))
    results, exported = _resume_each(folder, strategies)
    report(
        {
            "rank": hf.rank(),
            "files": shard_files,
            **{
                name: relative_difference(weights, results["same"])
                for name, weights in results.items()
                if name != "same"
            },
            "export": relative_difference(exported.get_weights(), first.get_weights()),
        }
    )


def expert_reshape(folder):
    """Checkpoint a Mixtral trained with its experts split over 2 replicas, each of 2 tensor
    ranks, ZeRO-1 slicing the other slots over the replicas (Adam, router loss on); resume it
    so without ZeRO-1, with experts = 1 on 4 replicas, and as a 2-stage pipeline of expert
    groups; and count the expert elements a rank holds when the model is built under
    hf.scope()."""
    saved = hf.Strategy("data", replicas=2, tensor=2, experts=2, shard_optimizer=True)
    strategies = {
        "same": hf.Strategy("data", replicas=2, tensor=2, experts=2),
        "experts1": hf.Strategy("data", replicas=4),
        "pipeline": hf.Strategy("hybrid", partitions=2, replicas=2, experts=2),
    }

    def fit(strategy, epochs, **kwargs):
        model = zoo.compiled("mixtral", "adam")
        hf.fit(
            model,
            zoo.text_batches("mixtral", 16),
            epochs=epochs,
            shuffle=False,
            verbose=0,
            strategy=strategy,
            **kwargs,
        )
        return model

    held = _expert_elements_held(2)
    first = fit(saved, 1, callbacks=[hf.callbacks.Checkpoint(folder, 2)])
    files = sorted(n for n in os.listdir(manifest.latest(folder)) if n.endswith(".npz"))
    pieces = _expert_pieces(manifest.latest(folder), files, first)
    results = {name: fit(s, 2, resume_from=folder).get_weights() for name, s in strategies.items()}
    exported = os.path.join(folder, "exported.keras")
    if hf.rank() == 0:
        hf.export(folder, exported)
    MPI.COMM_WORLD.Barrier()
    report(
        {
            "rank": hf.rank(),
            "files": files,
            "expert_pieces": pieces,
            **{
                name: relative_difference(weights, results["same"])
                for name, weights in results.items()
                if name != "same"
            },
            "export": relative_difference(
                keras.saving.load_model(exported).get_weights(), first.get_weights()
            ),
            "expert_elements_held": held,
            # in one process: the whole expert kernels and Adam's two slots of each
            "expert_elements_whole": 3 * sum(int(np.prod(v.shape)) for v in expert_weights(first)),
        }
    )


def _expert_pieces(folder, files, model) -> dict:
    """file -> how many pieces of expert weights it holds (files holding none left out)."""
    paths = {v.path for v in expert_weights(model)}
    experts = {f"w/{i}" for i, v in enumerate(model.weights) if v.path in paths}
    counts = {}
    for name in files:
        with np.load(os.path.join(folder, name)) as archive:
            found = [k for k in archive.files if "@" in k and k.partition("@")[0] in experts]
        if found:
            counts[name] = len(found)
    return counts


def _expert_elements_held(experts: int) -> int:
    """Elements of expert weights and Adam slots this rank holds after a step of a Mixtral
    built under hf.scope() with its experts split `experts` ways over the replicas."""
    with hf.scope():  # compiled inside too: keras_hub's compile makes metric objects there
        model = seeded_build(zoo.BUILDERS["mixtral"], "float32")
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = zoo.text_batches("mixtral", 16).take(1)
    hf.fit(model, batches, verbose=0, strategy=hf.Strategy("data", experts=experts))
    trainer = model._hyparflow_trainer[1]
    whole = [v for v in expert_weights(model) if not deferred.is_deferred(v)]
    shards = trainer.sharded_layers.experts.variables if trainer.sharded_layers.experts else whole
    names = [v.path.replace("/", "_") for v in shards]
    slots = [v for v in model.optimizer.variables if any(n in v.path for n in names)]
    held = {id(v): v for v in [*whole, *shards, *slots]}
    return sum(int(np.prod(v.shape)) for v in held.values())


def stall(folder):
    """Rank 1 stops answering; the watchdog must end the job."""

    class Hang(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1 and hf.rank() == 1:
                time.sleep(600)

    start = time.time()
    _fit_dropout_mlp([Hang()], watchdog_timeout=5)
    report({"finished": True, "elapsed": time.time() - start})  # must never happen


MODES = {
    f.__name__: f
    for f in (crash, resume, torn_save, after_torn, reshape, tensor_reshape, expert_reshape, stall)
}


def main():
    mode, folder = args()
    keras.config.disable_interactive_logging()
    MODES[mode](folder)


if __name__ == "__main__":
    main()
