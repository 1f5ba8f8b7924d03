"""Models with their own train_step or compute_loss, trained by Keras and by `hf.fit` (data R=2).

Run inside tests/mpi/data_inputs.py's launch (tests/test_keras_inputs.py checks the results):
each case is built twice from one seed, trained by Keras in this process and by `hf.fit`, and
the weights, the History and `hf.evaluate`'s logs are compared.
"""

import re
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from mpi4py import MPI

import hyparflow as hf
from tests.support.compare import history_difference, relative_difference
from tests.support.models import data


class GuideStep(keras.Model):
    """The Keras guide's "Customizing what happens in fit()": compute_loss, the tape, the
    optimizer's apply, every metric updated, their results returned."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class OwnLoss(keras.Model):
    """Keras's own step around an overridden compute_loss (an extra output penalty)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.1 * ops.mean(ops.square(y_pred))


class TwoOptimizers(keras.Model):
    """A GAN's shape without its noise: compiled without a loss, a second optimizer held as an
    attribute, its own loss tracker returned through `metrics`, and SGD with momentum
    updating the first layer, Adam the head."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_optimizer = keras.optimizers.Adam(0.01)
        self.tracker = keras.metrics.Mean(name="step_loss")

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = ops.mean(keras.losses.sparse_categorical_crossentropy(y, self(x, training=True)))
        body, head = self.trainable_variables[:2], self.trainable_variables[2:]
        grads = tape.gradient(loss, body + head)
        self.optimizer.apply(grads[:2], body)
        self.head_optimizer.apply_gradients(zip(grads[2:], head, strict=True))
        self.tracker.update_state(loss)
        return {"step_loss": self.tracker.result()}


class LambHead(TwoOptimizers):
    """`TwoOptimizers` with Lamb on the head: its per-variable trust ratio cannot be sliced."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_optimizer = keras.optimizers.Lamb(0.01)


class OneOptimizerTwice(TwoOptimizers):
    """`TwoOptimizers` whose attribute Adam updates the first layer, then the head: one
    optimizer on two sets of variables (Keras's own fails at the second)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = ops.mean(keras.losses.sparse_categorical_crossentropy(y, self(x, training=True)))
        grads = tape.gradient(loss, self.trainable_variables)
        self.head_optimizer.apply(grads[:2], self.trainable_variables[:2])
        self.head_optimizer.apply(grads[2:], self.trainable_variables[2:])
        return {}


class ExtraUpdate(keras.Model):
    """Its compiled optimizer updates every variable, then a second optimizer the head again."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra_optimizer = keras.optimizers.SGD(0.01, momentum=0.5)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.extra_optimizer.apply(grads[2:], self.trainable_variables[2:])
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GAN(keras.Model):
    """The Keras guide's GAN ("Customizing what happens in fit()"): a discriminator and a
    generator, each updated by an optimizer of its own held as an attribute (set by its own
    `compile`), the compiled optimizer unused. Its latent points are a fixed function of the
    real samples instead of random draws, so that Keras and each replica draw the same ones."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real):
        real = real[0] if isinstance(real, tuple) else real
        latent = ops.sin(3.0 * real[:, : self.latent_dim])
        fake = self.generator(latent)
        combined = ops.concatenate([fake, real], axis=0)
        labels = ops.concatenate([ops.ones_like(real[:, :1]), ops.zeros_like(real[:, :1])], 0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights, strict=True)
        )
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(latent))
            g_loss = self.loss_fn(ops.zeros_like(predictions), predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights, strict=True))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def build_gan():
    """A tiny seeded GAN on the 6 features of `X`, latent points of 4, the guide's Adam."""
    keras.utils.set_random_seed(3)
    discriminator = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )
    generator = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(6)]
    )
    model = GAN(discriminator, generator, latent_dim=4)
    model.compile(
        d_optimizer=keras.optimizers.Adam(0.003),
        g_optimizer=keras.optimizers.Adam(0.003),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return model


def build(kind, policy="float32", **adam):
    """`kind` over one seeded layer graph; compiled with Adam(0.01, **adam) unless it is
    `TwoOptimizers`; its layers' dtype policy `policy` (mixed_float16: a loss-scale
    optimizer). The `GAN` is its own (`build_gan`)."""
    if kind is GAN:
        return build_gan()
    keras.utils.set_random_seed(3)
    keras.config.set_dtype_policy(policy)
    try:
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        hidden = keras.layers.Dropout(0.3)(hidden)  # each replica takes its rows of Keras's mask
        outputs = keras.layers.Dense(3, activation="softmax", dtype="float32")(hidden)
        model = kind(inputs, outputs)
    finally:
        keras.config.set_dtype_policy("float32")
    if issubclass(kind, TwoOptimizers):
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    else:
        model.compile(
            optimizer=keras.optimizers.Adam(0.01, **adam),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    return model


X, Y = data("mlp")  # 70 samples, batches of 16: the last has 6, split 3 and 3
CASES = {  # name: (model class, samples); 69 samples: a last batch of 5, split 3 and 2
    "custom_train_step": (GuideStep, 70),
    "custom_compute_loss_uneven_last_batch": (OwnLoss, 69),
    "custom_step_two_optimizers_no_compiled_loss": (TwoOptimizers, 70),
}


def run(name: str) -> dict:
    """Keras, then `hf.fit` (data R=2) with validation and `hf.evaluate`, from one seed."""
    kind, n = CASES[name]
    x, y = X[:n], Y[:n]
    options = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    if kind is not TwoOptimizers:  # Keras's test_step needs a compiled loss
        options["validation_data"] = (X[:20], Y[:20])
    runs = []
    for fit in (
        lambda m: m.fit(x, y, **options),
        lambda m: hf.fit(m, x, y, **options, strategy="data"),
    ):
        model = build(kind)
        keras.utils.set_random_seed(7)  # the same dropout masks in both runs
        history = fit(model).history
        logs = None
        if "validation_data" in options:
            logs = hf.evaluate(model, X[:20], Y[:20], return_dict=True, verbose=0, strategy="data")
        runs.append((model, history, logs))
    (ref, ref_history, _), (model, history, logs) = runs
    evaluated = (
        0.0
        if logs is None
        else history_difference(logs, ref.evaluate(X[:20], Y[:20], return_dict=True, verbose=0))
    )
    return {
        "case": f"data:{name}",
        "weights": relative_difference(model.get_weights(), ref.get_weights()),
        "history": max(history_difference(history, ref_history), evaluated),
        "epochs": [len(next(iter(history.values()))), len(next(iter(ref_history.values())))],
        "keys": [sorted(history), sorted(ref_history)],
        "unpatched": all("apply" not in vars(o) for o in (model.optimizer, *_others(model))),
    }


def _others(model):
    return [v for v in vars(model).values() if isinstance(v, keras.optimizers.Optimizer)]


def with_table(kind):
    """A token table (row-sparse gradients) under `kind`'s step, Adam."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Flatten()(keras.layers.Embedding(10, 4)(inputs))
    model = kind(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return model


def refused(name: str, strategy: str, n: int) -> dict:
    """The error `hf.fit` raises for a GuideStep (or OwnLoss) it cannot train exactly."""
    kind = OwnLoss if "compute_loss" in name else GuideStep
    model, x = build(kind), X[:n]
    if "table" in name:
        model, x = with_table(kind), (np.abs(X[:n]) * 3).astype("int32") % 10
    try:
        hf.fit(model, x, Y[:n], batch_size=16, verbose=0, strategy=strategy)
        error = None
    except ValueError as raised:
        error = str(raised)
    return {"case": f"{strategy}:{name}", "error": error}


REFUSED = {  # name: (strategy, samples, what the error says)
    # 69 samples: a last batch of 5, which the step's per-call metric update cannot split
    "custom_train_step_uneven_last_batch": ("data", 69, "does not split evenly over 2"),
    "custom_compute_loss_pipeline": ("model", 70, "overrides Model.compute_loss"),
    # its optimizer would get the replicas' row slices summed densely (engine/custom_step.py)
    "custom_train_step_table": ("data", 70, "receive row-sparse gradients"),
}


SHARDED = {  # name: (model class, build options, Strategy options); on 2 and on 4 ranks
    "custom_train_step_shard_optimizer": (GuideStep, {}, {"shard_optimizer": True}),
    "custom_train_step_shard_gradients": (GuideStep, {}, {"shard_gradients": True}),
    # clipped by the whole model's norm, which each replica's slice alone does not know
    "custom_train_step_global_clipnorm": (
        GuideStep,
        {"global_clipnorm": 0.05},
        {"shard_gradients": True},
    ),
    # Keras's own step scales the loss: the replicas agree on skipping an overflowing step
    "custom_compute_loss_mixed_float16": (
        OwnLoss,
        {"policy": "mixed_float16"},
        {"shard_gradients": True},
    ),
    # ZeRO-3: the step's variables hold the gathered weights for the step alone
    "custom_train_step_shard_weights": (GuideStep, {}, {"shard_weights": True}),
    "custom_train_step_shard_weights_global_clipnorm": (
        GuideStep,
        {"global_clipnorm": 0.05},
        {"shard_weights": True},
    ),
    "custom_compute_loss_shard_weights_mixed_float16": (
        OwnLoss,
        {"policy": "mixed_float16"},
        {"shard_weights": True},
    ),
    # several optimizers, each stepping its own slices of the variables it is applied to
    # (sharded_optimizer/step_optimizers.py): the compiled one on part of the model
    "custom_step_two_optimizers_shard_optimizer": (TwoOptimizers, {}, {"shard_optimizer": True}),
    "custom_step_two_optimizers_shard_weights": (TwoOptimizers, {}, {"shard_weights": True}),
    # overlapping sets: the compiled optimizer on every variable, a second on the head again
    "custom_step_extra_update_shard_gradients": (ExtraUpdate, {}, {"shard_gradients": True}),
    "custom_step_extra_update_shard_weights": (ExtraUpdate, {}, {"shard_weights": True}),
    # the Keras guide's GAN: two attribute optimizers, the compiled one unused
    "custom_step_gan_shard_gradients": (GAN, {}, {"shard_gradients": True}),
    "custom_step_gan_shard_weights": (GAN, {}, {"shard_weights": True}),
}
MIXED_TOLERANCE = 6e-3  # tests/test_zero.py's: unsharded data parallelism is as far from Keras


def sharded(name: str) -> dict:
    """Keras, then `hf.fit` (data, every rank a replica) with the optimizer state sharded, from
    one seed; 64 samples in batches of 16, which split evenly over 2 or 4 replicas."""
    kind, build_options, sharding = SHARDED[name]
    data = (X[:64],) if kind is GAN else (X[:64], Y[:64])  # the GAN learns the samples alone
    options = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = hf.Strategy("data", **sharding)
    runs, probe = [], _HeldBetweenSteps()
    for fit in (
        lambda m: m.fit(*data, **options),
        lambda m: hf.fit(m, *data, **options, strategy=strategy, callbacks=[probe]),
    ):
        model = build(kind, **build_options)
        keras.utils.set_random_seed(7)  # the same dropout masks in both runs
        runs.append((model, fit(model).history))
    (ref, ref_history), (model, history) = runs
    return {
        "case": f"sharded:{name}",
        "weights": relative_difference(model.get_weights(), ref.get_weights()),
        "history": history_difference(history, ref_history),
        "slot_ratios": slot_ratios(model, ref),
        "saved_optimizers": saved_difference(model, ref),
        "unpatched": all("apply" not in vars(o) for o in _optimizers(model)),
        "held_between_steps": probe.held,
    }


def slot_ratios(model, reference) -> list:
    """For each optimizer the step applied (a slot of one element or more, in `reference`,
    trained by Keras alone), the elements of its slots this rank holds over Keras's."""
    ratios = []
    for mine, whole in zip(_optimizers(model), _optimizers(reference), strict=True):
        total = _slot_elements(whole)
        if total:
            ratios.append(_slot_elements(mine) / total)
    return ratios


def saved_difference(model, reference) -> float:
    """How far the optimizer slots in rank 0's saved files (each optimizer's
    `save_own_variables`, what `model.save` and `save_weights` write) are from Keras's, every
    optimizer's, whole; infinite where a shape differs (the same number on every rank). The
    scalars are left out: a loss-scale optimizer's own step counter and rate share their
    checkpoint keys (`opt/<name>`) with its inner optimizer's, so they are written as the
    inner one's (as before several optimizers were sliced)."""
    difference = None
    if hf.rank() == 0:
        written = [_slots(_written(o)) for o in _optimizers(model)]
        expected = [_slots(o.variables) for o in _optimizers(reference)]
        shapes = [[a.shape for a in state] for state in written + expected]
        half = len(written)
        same = shapes[:half] == shapes[half:]
        difference = float("inf")
        if same:
            difference = max(
                relative_difference(a, b) for a, b in zip(written, expected, strict=True)
            )
    return MPI.COMM_WORLD.bcast(difference)


def _slots(values) -> list:
    return [np.asarray(v) for v in values if len(v.shape) > 0]


def _written(optimizer) -> list:
    store = {}
    optimizer.save_own_variables(store)
    return [np.asarray(store[key]) for key in sorted(store, key=int)]


def _slot_elements(optimizer) -> int:
    return sum(int(np.prod(v.shape)) for v in optimizer.variables if len(v.shape) > 0)


def _optimizers(model) -> list:
    """The compiled optimizer, then those the model holds as attributes."""
    return [model.optimizer, *(o for o in _others(model) if o is not model.optimizer)]


class _Batches(keras.callbacks.Callback):
    """How many training batches a fit ran."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


class _HeldBetweenSteps(keras.callbacks.Callback):
    """Whether the model's first weight could be read after each training batch (ZeRO-3
    keeps it as slices over the replicas between steps)."""

    def __init__(self):
        super().__init__()
        self.held = []

    def on_train_batch_end(self, batch, logs=None):
        try:
            self.model.trainable_variables[0].numpy()
            self.held.append(True)
        except hf.NotHeldError:
            self.held.append(False)


SHARDED_REFUSED = {  # name: (model class, Strategy options, what the error says)
    # Lamb's trust ratio reads each whole variable: no replica can step a slice of the head
    "custom_step_lamb_head_shard_gradients": (
        LambHead,
        {"shard_gradients": True},
        "Lamb does not update each element",
    ),
    # its state is built once, for the slices of one set of variables
    "custom_step_one_optimizer_twice_shard_optimizer": (
        OneOptimizerTwice,
        {"shard_optimizer": True},
        "to 2 variables that are not the 2 it applied it to before",
    ),
}


def sharded_refused(name: str) -> dict:
    kind, sharding, _ = SHARDED_REFUSED[name]
    try:
        hf.fit(
            build(kind),
            X[:64],
            Y[:64],
            batch_size=16,
            verbose=0,
            strategy=hf.Strategy("data", **sharding),
        )
        error = None
    except ValueError as raised:
        # without the layers and optimizers it names: Keras's name counters differ by rank in
        # a launch where each rank trains other references first
        error = re.sub(r" \(\w+\)", "", str(raised).split(" (missing:")[0])
    return {"case": f"sharded:{name}", "error": error}


def resumed(sharding: dict) -> tuple[list, int]:
    """`ExtraUpdate` trained for an epoch with an `hf.callbacks.Checkpoint`, then resumed from
    it for a second, under `sharding`: its weights (its compiled optimizer restored, its
    attribute one, in no checkpoint, fresh: sharded or not) and the batches the resumed fit
    trained."""
    folder = MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if hf.rank() == 0 else None)
    strategy = hf.Strategy("data", **sharding)
    options = dict(batch_size=16, shuffle=False, verbose=0, strategy=strategy)
    try:
        for epochs in (1, 2):
            model = build(ExtraUpdate)
            keras.utils.set_random_seed(7)
            callbacks, batches = [hf.callbacks.Checkpoint(folder)], _Batches()
            hf.fit(
                model,
                X[:64],
                Y[:64],
                epochs=epochs,
                callbacks=[*callbacks, batches],
                resume=True,
                **options,
            )
    finally:
        MPI.COMM_WORLD.barrier()
        if hf.rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return model.get_weights(), batches.count


def resume_results() -> list[dict]:
    """A resumed ZeRO-3 custom step of two optimizers against the same resumed unsharded."""
    (plain, plain_batches), (sliced, batches) = resumed({}), resumed({"shard_weights": True})
    case = "sharded:custom_step_extra_update_resumed_shard_weights"
    weights = relative_difference(sliced, plain)
    return [{"case": case, "weights": weights, "batches_run": [batches, plain_batches]}]


def sharded_results() -> list[dict]:
    """The sharded cases and refusals (run by each launch: every rank a replica)."""
    return [sharded(name) for name in SHARDED] + [sharded_refused(name) for name in SHARDED_REFUSED]


def results() -> list[dict]:
    return [run(name) for name in CASES] + [
        refused(name, strategy, n) for name, (strategy, n, _) in REFUSED.items()
    ]
