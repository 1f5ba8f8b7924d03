"""Misconfigurations: each must raise a clear error on every rank, with no rank left blocked
in MPI.

Arguments: a case name, or `all`, and a scratch folder shared by the ranks.
- One case, uncaught: each rank records the exception that ends it (through `sys.excepthook`)
  before Python exits with status 1, by itself.
- `all`: every case in turn in one job, each error caught and recorded. That the next case
  trains on the same ranks shows that the error left no rank blocked and no message behind.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf
from mpi4py import MPI

import hyparflow as hf
from hyparflow.checkpoint.manifest import latest
from tests.support import zoo
from tests.support.models import compiled, data
from tests.support.report import args, report


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4, activation="relu")
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(x))


def subclassed():
    model = Subclassed()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model(np.zeros((1, 6), "float32"))
    return model


class OwnStep(keras.Model):
    """A functional model with its own train_step (a pipeline would skip it)."""

    def train_step(self, data):
        return super().train_step(data)


def with_own_train_step():
    inputs = keras.Input((6,))
    model = OwnStep(inputs, keras.layers.Dense(3, activation="softmax")(inputs))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


class FailsInTraining(keras.layers.Layer):
    """Builds and predicts, but raises while a training step is traced (on every rank)."""

    def call(self, x, training=None):
        if training:
            raise ValueError("boom: this layer cannot train")
        return x


def failing_in_training():
    inputs = keras.Input((6,))
    hidden = FailsInTraining()(keras.layers.Dense(4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


class FailsOnNaN(keras.layers.Layer):
    """Raises at run time, inside the compiled step, on the one stage or replica whose input
    holds a NaN: the others wait for it in MPI."""

    def call(self, x):
        return tf.debugging.check_numerics(x, "this stage failed mid-step")


def failing_mid_step():
    # Linear layers up to the check: a compiled Dense with ReLU (oneDNN's fused MatMul + BiasAdd
    # + ReLU, on CPUs where TensorFlow turns oneDNN on) turns NaN into 0, eager ReLU keeps it.
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8)(inputs)
    checked = FailsOnNaN(name="checked")(keras.layers.Dense(8)(hidden))
    activated = keras.layers.Activation("relu")(checked)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(activated))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def fail_mid_step(x, y, strategy):
    """Train on data with one NaN row (the second batch): one stage or replica fails."""
    x = np.where(np.arange(len(x))[:, None] == 13, np.nan, x)
    return fit(failing_mid_step(), x, y, strategy=strategy, shuffle=False)


def recovered(x, y, failing=lambda x, y: fit(failing_in_training(), x, y, strategy="data")):
    """A script that catches a failed fit goes on: the same ranks train another model."""
    try:
        failing(x, y)
    except Exception as error:  # noqa: BLE001 - whatever it raised, on every rank
        assert "boom" in str(error) or "mid-step" in str(error), error
    history = fit(compiled("mlp", "sgd"), x, y, strategy="model")
    raise RuntimeError(f"recovered: trained {len(history.history['loss'])} epoch after the error")


def with_noise():
    inputs = keras.Input((6,))
    hidden = keras.layers.GaussianNoise(0.1, name="noise")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def with_sum_reduction():
    model = compiled("mlp", "sgd")
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(reduction="sum"))
    return model


def checkpointed(folder, name="mlp"):
    """A real checkpoint of model `name` in `folder` (trained for one epoch)."""
    x, y = data(name, n=32)
    hf.fit(
        compiled(name, "sgd"),
        x,
        y,
        batch_size=8,
        verbose=0,
        strategy="model",
        callbacks=[hf.callbacks.Checkpoint(folder)],
    )
    return folder


def corrupt(folder):
    if hf.rank() == 0:
        with open(os.path.join(latest(folder), "stage-1.npz"), "r+b") as f:
            f.seek(100)
            f.write(b"garbage")
    MPI.COMM_WORLD.Barrier()
    return folder


def fit(model, x, y, **kwargs):
    kwargs.setdefault("batch_size", 8)
    return hf.fit(model, x, y, verbose=0, **kwargs)


def diverging():
    """A linear regression with a learning rate that overflows the weights within steps."""
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(1e20), loss="mse")
    return model


def odd_pair():
    """A Dense pair whose 5 middle units two tensor ranks cannot split (the automatic layout
    keeps it whole)."""
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation="relu", name="five_units")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def unseeded_shuffle(x, y):
    """The habit that breaks data sharing: each rank shuffles with its own generator."""
    order = np.random.default_rng(1000 + hf.rank()).permutation(len(x))
    return x[order], y[order]


def tensor(**options):
    return hf.Strategy("data", tensor=2, **options)


CASES = {
    # the automatic layout keeps the pair whole; a tensor_layout that asks to split it is refused
    "tensor_indivisible_units": lambda x, y, tmp: fit(
        odd_pair(), x, y, strategy=tensor(tensor_layout={"five_units/kernel": (None, "tensor")})
    ),
    "tensor_not_dividing_world": lambda x, y, tmp: fit(
        compiled("mlp", "sgd"), x, y, strategy=hf.Strategy("data", tensor=3)
    ),
    "wrong_world_size": lambda x, y, tmp: fit(
        compiled("mlp", "sgd"), x, y, strategy="hybrid", num_partitions=2, num_replicas=3
    ),
    "batch_not_divisible": lambda x, y, tmp: fit(
        compiled("mlp", "sgd"), x, y, batch_size=10, strategy="model", num_microbatches=4
    ),
    "subclassed_model_parallel": lambda x, y, tmp: fit(subclassed(), x, y, strategy="model"),
    "uncompiled": lambda x, y, tmp: fit(
        keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)]), x, y
    ),
    "unknown_strategy": lambda x, y, tmp: fit(compiled("mlp", "sgd"), x, y, strategy="pipeline"),
    "mismatched_lengths": lambda x, y, tmp: fit(compiled("mlp", "sgd"), x, y[:-3]),
    "wrong_input_shape": lambda x, y, tmp: fit(compiled("mlp", "sgd"), x[:, :5], y),
    "missing_split_layer": lambda x, y, tmp: fit(
        compiled("mlp", "sgd"), x, y, strategy=hf.Strategy("model", balance=["no_such_layer"])
    ),
    "empty_dataset": lambda x, y, tmp: hf.fit(
        compiled("mlp", "sgd"),
        tf.data.Dataset.from_tensor_slices((x[:0], y[:0])).batch(8),
        verbose=0,
        strategy="data",
    ),
    "nonfinite_data": lambda x, y, tmp: fit(
        compiled("mlp", "sgd"),
        np.where(np.arange(len(x))[:, None] == 5, np.nan, x),
        y,
        check_numerics=True,
    ),
    "own_train_step": lambda x, y, tmp: fit(with_own_train_step(), x, y, strategy="model"),
    "unsliceable_noise": lambda x, y, tmp: fit(with_noise(), x, y, strategy="data"),
    "synchronized_batchnorm_microbatches": lambda x, y, tmp: fit(
        compiled("batchnorm", "sgd"),
        x,
        y,
        strategy=hf.Strategy("data", sync_batchnorm=True, microbatches=2),
    ),
    "sum_reduction": lambda x, y, tmp: fit(with_sum_reduction(), x, y),
    "global_mean_microbatches": lambda x, y, tmp: fit(
        zoo.compiled("global_centered", "sgd"),
        x,
        y,
        strategy=hf.Strategy("data", microbatches=2),
    ),
    # a last batch of 1 sample: one replica would never join the global mean's allreduce
    "replica_without_rows": lambda x, y, tmp: fit(
        zoo.compiled("global_centered", "sgd"), x[:9], y[:9], strategy="data"
    ),
    "strict_added_losses": lambda x, y, tmp: fit(
        zoo.compiled("added_losses", "sgd"),
        x,
        y,
        strategy=hf.Strategy("data", strict_added_losses=True),
    ),
    "same_error_everywhere": lambda x, y, tmp: fit(failing_in_training(), x, y, strategy="data"),
    "caught_and_continued": lambda x, y, tmp: recovered(x, y),
    "one_stage_fails_mid_step": lambda x, y, tmp: fail_mid_step(
        x, y, hf.Strategy("model", balance=["checked"])
    ),
    "one_replica_fails_mid_step": lambda x, y, tmp: fail_mid_step(x, y, "data"),
    "caught_mid_step_and_continued": lambda x, y, tmp: recovered(
        x, y, lambda x, y: fail_mid_step(x, y, hf.Strategy("model", balance=["checked"]))
    ),
    "foreign_checkpoint": lambda x, y, tmp: fit(
        compiled("mlp", "sgd"),
        x,
        y,
        strategy="model",
        resume_from=checkpointed(os.path.join(tmp, "cnn"), "cnn"),
    ),
    "corrupted_checkpoint": lambda x, y, tmp: fit(
        compiled("mlp", "sgd"),
        x,
        y,
        strategy="model",
        resume_from=corrupt(checkpointed(os.path.join(tmp, "mlp"))),
    ),
    "missing_checkpoint": lambda x, y, tmp: fit(
        compiled("mlp", "sgd"), x, y, resume_from=os.path.join(tmp, "nothing-here")
    ),
    "resume_without_checkpoint_callback": lambda x, y, tmp: fit(
        compiled("mlp", "sgd"), x, y, resume=True
    ),
    "diverging_training": lambda x, y, tmp: fit(
        diverging(),
        x,
        y.astype("float32"),
        strategy="model",
        epochs=3,
        check_numerics=True,
    ),
    "different_data_on_each_rank": lambda x, y, tmp: fit(
        compiled("mlp", "sgd"), *unseeded_shuffle(x, y), strategy="model"
    ),
    "negative_watchdog": lambda x, y, tmp: fit(compiled("mlp", "sgd"), x, y, watchdog_timeout=-1),
}


def record_and_exit(kind, error, trace):
    """Record the error, then hand it to the hook `import hyparflow` installed (which aborts
    the job only for an error that did not reach every rank alike: comm/uncaught.py)."""
    report({"rank": hf.rank(), "type": kind.__name__, "error": str(error)})
    HYPARFLOW_HOOK(kind, error, trace)


HYPARFLOW_HOOK = sys.excepthook


def every_case(x, y, tmp) -> dict:
    """Each case's error on this rank (None if it raised none), every case in one job."""
    errors = {}
    for case, misuse in CASES.items():
        try:
            misuse(x, y, os.path.join(tmp, case))
            errors[case] = None
        except Exception as error:  # noqa: BLE001 - the error is what each case checks
            errors[case] = f"{type(error).__name__}: {error}"
    return errors


if __name__ == "__main__":
    case, tmp = args()
    keras.config.disable_interactive_logging()
    x, y = data("mlp", n=40)
    if case == "all":
        report({"rank": hf.rank(), "errors": every_case(x, y, tmp)})
        sys.exit(0)
    sys.excepthook = record_and_exit
    CASES[case](x, y, tmp)
    report({"rank": hf.rank(), "error": None})
