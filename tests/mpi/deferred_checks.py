"""Models built under hf.scope(): each rank allocates only its share, trains it exactly as
Keras does, checkpoints it, and hf.export writes the whole model; reading a weight another rank
holds fails clearly.

Arguments: a checkpoint folder shared by the ranks. Every rank trains the single-process Keras
reference itself (tiny models) and compares the weights it holds.
"""

import keras
import numpy as np
from mpi4py import MPI

import hyparflow as hf
from hyparflow import deferred
from tests.support import zoo
from tests.support.compare import history_difference, relative_difference
from tests.support.fits import fit_in_order
from tests.support.models import seeded_build
from tests.support.report import args, report, run_or_abort

BATCH = 16
NAME = "wide_mlp"
OPTIMIZER = "adam@0.001"  # Adam's defaults: what optimizer="adam" gives inside the scope


def deferred_model(compile_as: str):
    """zoo's wide MLP built under hf.scope() (same seed as the reference), compiled as zoo's:
    "string" compiles inside the scope with optimizer="adam" (the strategy.scope() habit),
    "object" with keras.optimizers.Adam(1e-3) made inside, "before" with an optimizer made
    before the scope, "after" after the scope: all four are Adam with its defaults."""
    before = zoo.optimizer(OPTIMIZER)
    with hf.scope():
        model = seeded_build(zoo.BUILDERS[NAME])
        inside = {"string": "adam", "object": keras.optimizers.Adam(1e-3), "before": before}
        if compile_as in inside:
            model.compile(
                inside[compile_as], "sparse_categorical_crossentropy", metrics=["accuracy"]
            )
    if compile_as == "after":
        model.compile(before, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def reference(epochs: int):
    x, y = zoo.data(NAME)
    model = zoo.compiled(NAME, OPTIMIZER)
    model.compile(zoo.optimizer(OPTIMIZER), "sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, history


def held_report(model, ref) -> dict:
    """Which weights this rank holds, how far they are from Keras's, and whether reading one it
    does not hold fails with NotHeldError."""
    held = [i for i, v in enumerate(model.weights) if not deferred.is_deferred(v)]
    diff = relative_difference(
        [model.weights[i].numpy() for i in held], [ref.weights[i].numpy() for i in held]
    )
    trainer = model._hyparflow_trainer[1]
    shards = trainer.sharded_layers.tensor.by_path() if trainer.sharded_layers.tensor else {}
    shard_diffs = []
    for i, v in enumerate(model.weights):
        if v.path in shards:
            piece = trainer.stage_state.split[v.path]  # this tensor rank's part of the whole
            expected = piece.cut(ref.weights[i].numpy())
            shard_diffs.append(relative_difference([shards[v.path].numpy()], [expected]))
    refused = None
    missing = [v for v in model.weights if deferred.is_deferred(v)]
    if missing:
        try:
            missing[0].numpy()
        except deferred.NotHeldError as error:
            refused = str(error)
    return {
        "held": held,
        "count": len(model.weights),
        "held_bytes": sum(model.weights[i].numpy().nbytes for i in held),
        "weights": diff,
        "shards": max(shard_diffs, default=0.0),
        "split": len(shards),
        "refused": refused,
        # the step counter made from a value (inside the scope for "string" and "object")
        "steps": [int(m.optimizer.iterations.numpy()) for m in (model, ref)],
    }


def replicated_layouts(x, y, ref2, ref_history) -> dict:
    """Two stages x two replicas: with ZeRO-1, and interleaved."""
    result = {}
    # two stages x two replicas with ZeRO-1: each replica keeps half its stage's Adam state;
    # the optimizer made before the scope, compiled inside it
    model = deferred_model("before")
    zero = hf.Strategy("hybrid", partitions=2, replicas=2, shard_optimizer=True)
    history = fit_in_order(model, x, y, BATCH, 2, zero)
    result["P2R2-zero"] = held_report(model, ref2)
    result["P2R2-zero"]["history"] = history_difference(history.history, ref_history.history)

    # the same grid interleaved: each rank allocates and trains the weights of its two chunks
    model = deferred_model("string")
    interleaved = hf.Strategy("hybrid", partitions=2, replicas=2, schedule="interleaved")
    history = fit_in_order(model, x, y, BATCH, 2, interleaved)
    result["P2R2-interleaved"] = held_report(model, ref2)
    result["P2R2-interleaved"]["history"] = history_difference(history.history, ref_history.history)
    return result


def main():
    folder = args()[0]
    x, y = zoo.data(NAME)
    ref2, ref_history = reference(epochs=2)
    ref1, _ = reference(epochs=1)
    result = {}

    # four pipeline stages, compiled inside the scope with optimizer="adam"
    model = deferred_model("string")
    strategy = hf.Strategy("model", partitions=4)
    history = fit_in_order(model, x, y, BATCH, 2, strategy)
    result["P4"] = held_report(model, ref2)
    result["P4"]["history"] = history_difference(history.history, ref_history.history)
    result["P4"]["predict"] = relative_difference(
        [hf.predict(model, x, batch_size=BATCH, strategy=strategy)],
        [ref2.predict(x, batch_size=BATCH, verbose=0)],
    )

    # another layout would start the weights this rank never held from scratch: refused
    try:
        hf.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0, strategy="data")
        result["P4"]["relayout"] = None
    except Exception as error:  # noqa: BLE001 - the test checks which
        result["P4"]["relayout"] = f"{type(error).__name__}: {error}"

    # two stages x two tensor ranks: the whole split variables are never allocated; compiled
    # inside the scope with an optimizer object made there
    model = deferred_model("object")
    stages_by_tensor = hf.Strategy("model", partitions=2, tensor=2)
    history = fit_in_order(model, x, y, BATCH, 2, stages_by_tensor)
    result["P2T2"] = held_report(model, ref2)
    result["P2T2"]["history"] = history_difference(history.history, ref_history.history)

    result |= replicated_layouts(x, y, ref2, ref_history)

    # a checkpoint of one epoch on P2xT2, exported, then resumed as four replicas
    model = deferred_model("after")
    fit_in_order(
        model, x, y, BATCH, 1, stages_by_tensor, callbacks=[hf.callbacks.Checkpoint(folder)]
    )
    if MPI.COMM_WORLD.Get_rank() == 0:
        path = hf.export(folder, folder + "/exported.keras")
        exported = keras.saving.load_model(path)
        result["export"] = relative_difference(exported.get_weights(), ref1.get_weights())
    model = deferred_model("string")  # data parallel, compiled inside with optimizer="adam"
    fit_in_order(model, x, y, BATCH, 2, hf.Strategy("data", replicas=4), resume_from=folder)
    result["resumed"] = relative_difference(model.get_weights(), ref2.get_weights())
    result["resumed_steps"] = [int(m.optimizer.iterations.numpy()) for m in (model, ref2)]
    report(result)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    run_or_abort(main)
