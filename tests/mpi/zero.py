"""ZeRO (`Strategy(shard_optimizer=True)`, `shard_gradients`, `shard_weights`) under a real
mpirun: exactness, slot sizes, bytes, refusals and checkpoints that change layout on resume.

Usage: `python -m tests.mpi.zero OUT FOLDER CASE_JSON...`. Each case (tests/support/cases.py,
a zoo model) is trained by hf.fit and compared with Keras's own fit (tests/support/references.py).
Then, on 2 ranks, the refusals, a subclassed model under ZeRO-3 and a resume between ZeRO on
and off; on 4 ranks, a resume that changes R and P.
"""

import contextlib
import os
import shutil

import keras
import numpy as np
import tensorflow as tf
from mpi4py import MPI

import hyparflow as hf
from hyparflow.checkpoint import manifest
from hyparflow.engine import events
from hyparflow.engine.sharded_optimizer import sharded_weights
from hyparflow.engine.stages import layer_gathering
from tests.mpi.reliability import BATCH, EPOCHS, _resume_each, train
from tests.support import references, zoo
from tests.support.cases import Case
from tests.support.compare import history_difference, relative_difference
from tests.support.fits import fit_in_order
from tests.support.report import args, report

SLOTS = {"adam": 2, "sgd": 1}  # optimizer slots per element (SGD with momentum)


def run(case: Case) -> dict:
    x, y, batch_size, epochs = zoo.training_data(case.model)
    reference = references.zoo_fit(case.model, case.optimizer, case.policy)
    model = zoo.compiled(case.model, case.optimizer, case.policy)
    history = fit_in_order(model, x, y, batch_size, epochs, hf.Strategy(**case.strategy_options()))
    trainer = model._hyparflow_trainer[1]
    zero = trainer.parts.sharded_update
    weights = trainer.parts.sharded_weights
    # the optimizer's per-element state on this rank, against the unsharded stage's
    slot_elements = sum(
        int(np.prod(v.shape)) for v in model.optimizer.variables if len(v.shape) > 0
    )
    stage_elements = sum(int(np.prod(v.shape)) for v in trainer.variables)
    # embedding tables stay whole (their slots too): the ratio of the sharded rest
    table_elements = sum(int(np.prod(v.shape)) for v in zero.tables) if zero else 0
    slots = SLOTS[case.optimizer.split("+")[0]]
    return {
        "case": case.id,
        "weights": relative_difference(model.get_weights(), reference["weights"]),
        "history": history_difference(history.history, reference["history"]),
        "zero": zero is not None,
        "slot_ratio": slot_elements / (slots * stage_elements),
        # None: the stage holds tables alone (a pipeline's first stage over an embedding)
        "dense_slot_ratio": (slot_elements - slots * table_elements)
        / (slots * (stage_elements - table_elements))
        if stage_elements > table_elements
        else None,
        "sent_bytes": zero.sent_bytes if zero else None,
        "step_bytes": zero.step_bytes if zero else None,
        "allreduce_bytes": zero.allreduce_bytes if zero else None,
        "steps": trainer.step,
        "elements": stage_elements,
        "groups": len(zero.groups) if zero else 0,
        # segments updated inside the backward (update_by_segment), all steps
        "segment_updates": getattr(trainer.parts.segment_update, "early_updates", None),
        "shards_gradients": trainer.shards_gradients,
        "shards_weights": trainer.shards_weights,
        "gathered_bytes": weights.sent_bytes if weights else None,
        "restores": weights.restores if weights else None,
        # ZeRO-3: backwards that followed their forward and differentiated its kept tape, not
        # gathering the last segment again; what that segment's gather sends
        "reused": _last_segment(trainer).reused_forwards if weights else None,
        "last_segment_bytes": sum(g.allgather_bytes for g in weights.segments[-1])
        if weights
        else None,
        "held_after": _held(model),
        "segments": len(getattr(trainer.parts.runner, "segments", [trainer.parts.runner])),
        "backwards": trainer.step  # one micro-batch a step (keras_hub's batched datasets)
        if batch_size is None
        else _backwards(len(x), batch_size, epochs, trainer.strategy),
    }


def _last_segment(trainer):
    """The runner of the stage's last segment (the stage's own where it is not cut)."""
    return getattr(trainer.parts.runner, "segments", [trainer.parts.runner])[-1]


def _held(model) -> bool:
    """Whether every weight of `model` holds a value (ZeRO-3 gives them back at the end)."""
    try:
        model.get_weights()
    except hf.NotHeldError:
        return False
    return True


def _backwards(samples: int, batch_size: int, epochs: int, strategy) -> int:
    """Each replica's backwards in the fit: a step's micro-batches, fewer in a last batch
    smaller than micro-batches x replicas (`PipelineWalk.microbatches`)."""
    sizes = [min(batch_size, samples - start) for start in range(0, samples, batch_size)]
    per_step = [max(1, min(strategy.microbatches, size // strategy.replicas)) for size in sizes]
    return epochs * sum(per_step)


def refusals() -> dict:
    """The error each optimizer or option that ZeRO cannot shard raises (on every rank)."""
    x, y = zoo.data("wide_mlp", n=32)
    found = {}
    for name, (optimizer, options) in {
        "lamb": (keras.optimizers.Lamb(), {}),
        "clipnorm": (keras.optimizers.Adam(clipnorm=1.0), {}),
        "overlap": (keras.optimizers.Adam(), {"overlap_groups": 2}),
        "regularizer": (keras.optimizers.Adam(), {"shard_weights": True}),  # wide_mlp's L2
    }.items():
        model = zoo.seeded_build(zoo.BUILDERS["wide_mlp"])
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        strategy = hf.Strategy("data", shard_optimizer=True, **options)
        try:
            hf.fit(model, x, y, batch_size=16, epochs=1, verbose=0, strategy=strategy)
            found[name] = None
        except Exception as error:  # noqa: BLE001 - the message is what the test checks
            found[name] = str(error)
    return found


class Residual(keras.Model):
    """A subclassed model (no layer graph to cut): residual Dense blocks, LayerNorm, dropout."""

    def __init__(self):
        super().__init__()
        self.stem = keras.layers.Dense(16)
        self.blocks = [
            (keras.layers.Dense(32, activation="gelu"), keras.layers.Dense(16)) for _ in range(2)
        ]
        self.norm = keras.layers.LayerNormalization()
        self.dropout = keras.layers.Dropout(0.2)
        self.head = keras.layers.Dense(3, activation="softmax")

    def call(self, x, training=False):
        h = self.stem(x)
        for widen, narrow in self.blocks:
            h = self.norm(h + narrow(self.dropout(widen(h), training=training)))
        return self.head(h)


def _compiled(kind, sample):
    """A `kind` model from seed 5, built on `sample`, compiled with Adam for 3 classes."""
    keras.utils.set_random_seed(5)
    model = kind()
    model(sample)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return model


def _residual():
    return _compiled(Residual, np.zeros((1, 6), "float32"))


def subclassed(shard: str) -> dict:
    """A subclassed model with `shard` ("shard_weights" or "shard_gradients") against Keras's
    fit from the same seeds, validation included, then `hf.evaluate` on the trained model: its
    one stage (not cut) gathers its weights whole for each call under ZeRO-3, and keeps whole
    gradients under ZeRO-2."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.integers(0, 3, size=64)
    validation = (x[:32] * 0.5, y[:32])
    reference = _residual()
    keras.utils.set_random_seed(7)  # the same dropout masks in both runs
    expected = reference.fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, validation_data=validation
    )
    model = _residual()
    keras.utils.set_random_seed(7)
    strategy = hf.Strategy("data", **{shard: True})
    history = fit_in_order(model, x, y, 16, 2, strategy, validation_data=validation)
    evaluated = hf.evaluate(model, x, y, batch_size=16, verbose=0, strategy=strategy)
    trainer = model._hyparflow_trainer[1]
    found = {
        "weights": relative_difference(model.get_weights(), reference.get_weights()),
        "history": history_difference(history.history, expected.history),
        "evaluated": abs(evaluated - reference.evaluate(x, y, batch_size=16, verbose=0)),
        "shards_weights": trainer.shards_weights,
        "segments": len(getattr(trainer.parts.runner, "segments", [trainer.parts.runner])),
        "slot_elements": sum(
            int(np.prod(v.shape)) for v in model.optimizer.variables if len(v.shape) > 0
        ),
        "elements": sum(int(np.prod(v.shape)) for v in model.trainable_variables),
    }
    if shard != "shard_weights":
        return found
    found["slice_elements"] = sum(
        int(np.prod(g.variable.shape)) for g in trainer.parts.sharded_weights.groups
    )
    return {**found, **_gather_spans(model, x, y, strategy)}  # one more epoch, recorded


class TokenBlock(keras.layers.Layer):
    """A block whose sublayers take `training` from Keras's call context, normalise over the
    global batch and add a loss: what a layer's recomputation must replay."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(16, activation="gelu")
        self.norm = keras.layers.BatchNormalization(synchronized=True)
        self.dropout = keras.layers.Dropout(0.3)

    def call(self, x):
        h = self.dropout(self.norm(self.dense(x)))
        self.add_loss(1e-2 * keras.ops.mean(keras.ops.square(keras.ops.cast(h, "float32"))))
        return x + h


class Tokens(keras.Model):
    """A subclassed model over token ids: an embedding table (kept whole), two blocks, a head."""

    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(40, 16)
        self.blocks = [TokenBlock() for _ in range(2)]
        self.head = keras.layers.Dense(3, activation="softmax")

    def call(self, ids, training=False):
        h = keras.ops.mean(self.embed(ids), axis=1)
        for block in self.blocks:
            h = block(h, training=training)
        return self.head(h)


def _tokens():
    return _compiled(Tokens, np.zeros((1, 5), "int32"))


def subclassed_blocks(policy: str, shard=None) -> dict:
    """`Tokens` under ZeRO-3 (`shard`: other Strategy flags) against Keras's fit from the same
    seeds, in `policy`: its blocks gather their weights around their calls and recompute them
    in the backward."""
    shard = {"shard_weights": True} if shard is None else shard
    rng = np.random.default_rng(1)
    x = rng.integers(0, 40, size=(64, 5)).astype("int32")
    y = rng.integers(0, 3, size=64)
    previous = keras.config.dtype_policy().name
    keras.config.set_dtype_policy(policy)
    try:
        reference = _tokens()
        keras.utils.set_random_seed(7)
        reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        model = _tokens()
        keras.utils.set_random_seed(7)
        fit_in_order(model, x, y, 16, 2, hf.Strategy("data", **shard))
    finally:
        keras.config.set_dtype_policy(previous)
    trainer = model._hyparflow_trainer[1]
    return {
        "weights": relative_difference(model.get_weights(), reference.get_weights()),
        "scatters": trainer.traffic.of(layer_gathering.SCATTER_TAG).calls,
        "steps": trainer.step,
    }


@contextlib.contextmanager
def _without_graph_rewrites():
    """TensorFlow's graph optimizer (Grappler) off for the functions traced meanwhile: it
    rewrites each graph on its own (fusions, reordered float16 arithmetic), so two graphs of
    one computation round differently, by 1e-2 after 8 float16 steps."""
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})


def mixed_blocks() -> dict:
    """`Tokens` under mixed_float16, ZeRO-3 against plain data parallelism, both compiled
    without graph rewrites: the recomputing backward's float16 arithmetic is the forward's.
    (Against Keras the suite's mixed tolerance, 6e-3, is as wide as such a drift.)"""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 40, size=(64, 5)).astype("int32")
    y = rng.integers(0, 3, size=64)
    trained = []
    keras.config.set_dtype_policy("mixed_float16")
    try:
        with _without_graph_rewrites():
            for shard in ({}, {"shard_weights": True}):
                model = _tokens()
                keras.utils.set_random_seed(7)
                fit_in_order(model, x, y, 16, 2, hf.Strategy("data", **shard))
                trained.append(model)
    finally:
        keras.config.set_dtype_policy("float32")
    plain, sharded = trained
    return {
        "weights": relative_difference(sharded.get_weights(), plain.get_weights()),
        "applied": [int(m.optimizer.inner_optimizer.iterations.numpy()) for m in trained],
        "scatters": sharded._hyparflow_trainer[1].traffic.of(layer_gathering.SCATTER_TAG).calls,
    }


def _small_mlp(scope: bool):
    keras.utils.set_random_seed(0)
    optimizer = keras.optimizers.Adam(1e-2)  # before the scope (docs/big_models.md)
    with hf.scope() if scope else contextlib.nullcontext():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(32, activation="relu")(inputs)
        h = keras.layers.Dense(32, activation="relu")(h)
        model = keras.Model(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer, "mse")
    return model


def small_mlp_trained(seed: int):
    """64 random samples (`seed`) of 8 features and 3 targets, and the small MLP Keras's fit
    trained on them for 2 epochs of 4 batches, in order."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    reference = _small_mlp(scope=False)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return x, y, reference


def scoped(folder: str) -> dict:
    """ZeRO-3 on a model built under hf.scope() (each rank allocates its slices only) against
    Keras's fit: after the fit each replica still holds only its slices (reading a weight says
    how to write the model), `hf.evaluate` gathers them, and the checkpoint `hf.export` writes
    holds the whole weights and optimizer state."""
    x, y, reference = small_mlp_trained(seed=0)
    model = _small_mlp(scope=True)
    saved = folder + "-scoped"
    strategy = hf.Strategy("data", shard_weights=True)
    fit_in_order(model, x, y, 16, 2, strategy, callbacks=[hf.callbacks.Checkpoint(saved)])
    try:
        model.get_weights()
        found = {"held": None}
    except hf.NotHeldError as error:
        found = {"held": str(error)}
    evaluated = hf.evaluate(model, x, y, batch_size=16, verbose=0, strategy=strategy)
    found["evaluated"] = abs(evaluated - reference.evaluate(x, y, batch_size=16, verbose=0))
    if hf.rank() == 0:
        exported = keras.saving.load_model(hf.export(saved, saved + "/model.keras"))
        found["weights"] = relative_difference(exported.get_weights(), reference.get_weights())
        found["slots"] = relative_difference(
            [v.numpy() for v in exported.optimizer.variables],
            [v.numpy() for v in reference.optimizer.variables],
        )
    return found


def _gather_spans(model, x, y, strategy) -> dict:
    """One more epoch recorded (as the profiler records it): how many gather spans its steps
    hold, how many steps, and whether each gather lies inside a forward or backward span."""
    trainer = model._hyparflow_trainer[1]
    recorder = events.Recorder()
    trainer.attach_recorder(recorder)
    fit_in_order(model, x, y, 16, 1, strategy)
    trainer.attach_recorder(None)
    records = recorder.take()
    spans = [s for record in records for s in record.spans]
    gathers = [s for s in spans if s.kind == events.GATHER]
    compute = [s for s in spans if s.kind in events.COMPUTE]
    inside = [any(c.start <= g.start <= g.end <= c.end for c in compute) for g in gathers]
    transfers = trainer.traffic.of(sharded_weights.TRANSFER_TAG)
    waits = trainer.traffic.of(sharded_weights.WAIT_TAG)
    scatters = trainer.traffic.of(layer_gathering.SCATTER_TAG)
    return {
        "scatters": scatters.calls,
        "ahead": trainer.traffic.of(layer_gathering.AHEAD_TAG).calls,
        "gather_spans": len(gathers),
        "recorded_steps": len(records),
        "inside": all(inside),
        "transfers": transfers.calls,
        "waits": waits.calls,
        "steps": trainer.step,
    }


def resumes_two(folder: str) -> dict:
    """A ZeRO checkpoint resumed with ZeRO, without it, as a pipeline (R 2 -> 1) and with ZeRO
    by segment (slices of each segment); an unsharded one resumed with ZeRO and ZeRO-3, a ZeRO
    by segment one without ZeRO, a ZeRO-3 one without ZeRO and with ZeRO-1."""
    zero = hf.Strategy("data", shard_optimizer=True)
    by_segment = hf.Strategy("data", shard_optimizer=True, update_by_segment=True)
    train(folder, strategy=zero, epochs=2, dropout=0.0)
    files = sorted(n for n in os.listdir(manifest.latest(folder)) if n.endswith(".npz"))
    results, _ = _resume_each(
        folder,
        {
            "same": zero,
            "off": hf.Strategy("data"),
            "model2": hf.Strategy("model", partitions=2),
            "segments": by_segment,
        },
    )
    plain = folder + "-plain"
    train(plain, strategy=hf.Strategy("data"), epochs=2, dropout=0.0)
    zero3 = hf.Strategy("data", shard_weights=True)
    plain_results, _ = _resume_each(
        plain, {"same": hf.Strategy("data"), "on": zero, "zero3": zero3}
    )
    # ZeRO-3 saves whole weights at an epoch's end (given back for the callbacks) and its
    # optimizer slices; inside an epoch each replica its slices of the weights too
    sharded = folder + "-zero3"
    train(sharded, strategy=zero3, epochs=2, dropout=0.0)
    zero3_results, _ = _resume_each(
        sharded, {"same": zero3, "off": hf.Strategy("data"), "zero1": zero}
    )
    inside = _inside_epoch(sharded, step=6)  # of 4 steps an epoch: the second one's middle
    inside_results, _ = _resume_each(inside["folder"], {"same": zero3, "off": hf.Strategy("data")})
    # the same step of the unsharded run (whole weights): the epoch's end would not do, its
    # learning rate was lowered there by the run's ReduceLROnPlateau, which resumes lack
    plain_inside, _ = _resume_each(
        _inside_epoch(plain, step=6)["folder"], {"same": hf.Strategy("data")}
    )
    segmented = folder + "-segments"
    model, _ = train(segmented, strategy=by_segment, epochs=2, dropout=0.0)
    segmented_results, _ = _resume_each(segmented, {"same": by_segment, "off": hf.Strategy("data")})
    return {
        "files": files,
        "off": relative_difference(results["off"], results["same"]),
        "model2": relative_difference(results["model2"], results["same"]),
        "segments": relative_difference(results["segments"], results["same"]),
        "on": relative_difference(plain_results["on"], plain_results["same"]),
        "segments_off": relative_difference(segmented_results["off"], segmented_results["same"]),
        "zero3_on": relative_difference(plain_results["zero3"], plain_results["same"]),
        "zero3_off": relative_difference(zero3_results["off"], zero3_results["same"]),
        "zero3_zero1": relative_difference(zero3_results["zero1"], zero3_results["same"]),
        # resumed from inside the epoch, to the unsharded run's checkpoint of the same step
        "zero3_inside": relative_difference(inside_results["same"], plain_inside["same"]),
        "zero3_inside_off": relative_difference(inside_results["off"], plain_inside["same"]),
        "zero3_inside_keys": inside["keys"],
        "segment_groups": len(model._hyparflow_trainer[1].parts.sharded_update.segments),
    }


def _inside_epoch(directory: str, step: int) -> dict:
    """The checkpoint of `step` in `directory`, copied alone into a folder of its own (so that
    it is the latest there), and its files' weight keys: per file, how many are whole
    entries and how many flat ranges (`w/<i>#<start>:<stop>/<shape>`)."""
    source = os.path.join(directory, f"ckpt-{step:09d}")
    target = f"{directory}-step-{step}"
    if hf.rank() == 0:
        shutil.copytree(source, os.path.join(target, os.path.basename(source)))
    MPI.COMM_WORLD.Barrier()
    keys = {}
    for name in sorted(n for n in os.listdir(source) if n.endswith(".npz")):
        with np.load(os.path.join(source, name)) as archive:
            weights = [k for k in archive.files if k.startswith("w/")]
        keys[name] = {
            "whole": sum("#" not in k for k in weights),
            "ranges": sum("#" in k for k in weights),
        }
    return {"folder": target, "keys": keys}


def resumes_four(folder: str) -> dict:
    """A 2-replica x 2-tensor-rank ZeRO checkpoint (slices of shards) resumed with R 2 -> 4
    and T 2 -> 1, as a 2-stage pipeline, and without ZeRO."""
    zero = hf.Strategy("data", replicas=2, tensor=2, shard_optimizer=True)
    train(folder, strategy=zero, epochs=2, dropout=0.0)
    files = sorted(n for n in os.listdir(manifest.latest(folder)) if n.endswith(".npz"))
    results, _ = _resume_each(
        folder,
        {
            "same": zero,
            "data4": hf.Strategy("data", shard_optimizer=True),
            "hybrid": hf.Strategy("hybrid", partitions=2, replicas=2, shard_optimizer=True),
            "off": hf.Strategy("data", replicas=2, tensor=2),
        },
    )
    return {
        "files": files,
        **{k: relative_difference(v, results["same"]) for k, v in results.items() if k != "same"},
        **_zero3_inside_epoch_with_tensor_ranks(folder),
    }


def _zero3_inside_epoch_with_tensor_ranks(folder: str) -> dict:
    """A ZeRO-3 R=2 x T=2 checkpoint inside an epoch (each replica's slices of its tensor
    pieces, and shard 0's of the whole variables) resumed as saved and as R=4 without ZeRO,
    against the unsharded R=2 x T=2 run's checkpoint of the same step."""
    zero3 = hf.Strategy("data", replicas=2, tensor=2, shard_weights=True)
    plain = hf.Strategy("data", replicas=2, tensor=2)
    train(folder + "-zero3", strategy=zero3, epochs=2, dropout=0.0)
    train(folder + "-plain", strategy=plain, epochs=2, dropout=0.0)
    inside = _inside_epoch(folder + "-zero3", step=6)
    results, _ = _resume_each(inside["folder"], {"same": zero3, "data4": hf.Strategy("data")})
    expected, _ = _resume_each(_inside_epoch(folder + "-plain", step=6)["folder"], {"same": plain})
    return {
        "zero3_inside": relative_difference(results["same"], expected["same"]),
        "zero3_inside_data4": relative_difference(results["data4"], expected["same"]),
        "zero3_inside_keys": inside["keys"],
    }


class _PredictAtEpochEnd(keras.callbacks.Callback):
    """Calls Keras's own `model.predict` at every epoch's end (traced over the weights the
    epoch's end gives back), keeping how far it is from an eager call of the model."""

    def __init__(self, x):
        super().__init__()
        self.x, self.gaps = x, []

    def on_epoch_end(self, epoch, logs=None):
        predicted = self.model.predict(self.x, verbose=0)
        self.gaps.append(relative_difference([predicted], [self.model(self.x).numpy()]))


def keras_predict_around() -> dict:
    """Keras's `model.predict`, compiled before a ZeRO-3 fit and during it, reads the trained
    weights afterwards (ZeRO-3 puts new backend variables behind the model's weights, which
    a step compiled over the old ones would go on reading)."""
    x, y, _ = small_mlp_trained(seed=1)
    model = _small_mlp(scope=False)
    before = model.predict(x, verbose=0)  # Keras compiles and keeps its predict step
    probe = _PredictAtEpochEnd(x)
    fit_in_order(model, x, y, 16, 2, hf.Strategy("data", shard_weights=True), callbacks=[probe])
    after = model.predict(x, verbose=0)
    return {
        "during": probe.gaps,
        "after": relative_difference([after], [model(x).numpy()]),
        "trained": relative_difference([after], [before]),
    }


def main():
    folder, *cases = args()
    keras.config.disable_interactive_logging()
    cases = [Case.from_json(c) for c in cases]
    references.prefetch([references.zoo_request(c.model, c.optimizer, c.policy) for c in cases])
    results = [run(c) for c in cases]
    extra = {}
    if hf.size() == 2:
        extra = {
            "refusals": refusals(),
            "subclassed": subclassed("shard_weights"),
            "subclassed_zero2": subclassed("shard_gradients"),
            "blocks": subclassed_blocks("float32"),
            "mixed_blocks": mixed_blocks(),
            "scoped": scoped(folder),
            "predict": keras_predict_around(),
            "resume": resumes_two(folder),
        }
    elif hf.size() == 4:
        extra = {
            "subclassed": subclassed("shard_weights"),
            "subclassed_zero2": subclassed("shard_gradients"),
            "resume": resumes_four(folder),
        }
    report({"rank": hf.rank(), "results": results, **extra})


assert (BATCH, EPOCHS) == (16, 3)  # the reliability scenario's run, which the resumes reuse

if __name__ == "__main__":
    main()
