"""Misconfigurations: each must raise a clear error on every rank, with no rank left blocked.

Arguments: case names. Each case's error is caught and reported per rank; the final argument
"uncaught:<case>" lets one case escape, to show that the whole job then ends non-zero.
"""

import sys

import keras
import numpy as np

import hyparflow as hf
from tests.mpi.models import compiled, data
from tests.mpi.report import args, report


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


def with_activity_regularizer():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4, activity_regularizer="l2")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def with_sum_reduction():
    model = compiled("mlp", "sgd")
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(reduction="sum"))
    return model


CASES = {
    "wrong_world_size": lambda x, y: hf.fit(
        compiled("mlp", "sgd"), x, y, batch_size=8, strategy="hybrid",
        num_partitions=2, num_replicas=3,
    ),
    "batch_not_divisible": lambda x, y: hf.fit(
        compiled("mlp", "sgd"), x, y, batch_size=10, strategy="model", num_microbatches=4
    ),
    "subclassed_model_parallel": lambda x, y: hf.fit(
        subclassed(), x, y, batch_size=8, strategy="model"
    ),
    "uncompiled": lambda x, y: hf.fit(keras.Sequential([keras.Input((6,)),
                                                          keras.layers.Dense(3)]), x, y),
    "unknown_strategy": lambda x, y: hf.fit(compiled("mlp", "sgd"), x, y, strategy="pipeline"),
    "mismatched_lengths": lambda x, y: hf.fit(
        compiled("mlp", "sgd"), x, y[:-3], batch_size=8, strategy="data"
    ),
    "activity_regularizer": lambda x, y: hf.fit(
        with_activity_regularizer(), x, y, batch_size=8, strategy="data"
    ),
    "sum_reduction": lambda x, y: hf.fit(with_sum_reduction(), x, y, batch_size=8),
}  # fmt: skip


def main():
    x, y = data("mlp", n=40)
    outcomes = {}
    for case in args():
        if case.startswith("uncaught:"):
            CASES[case.split(":", 1)[1]](x, y)
            continue
        try:
            CASES[case](x, y)
            outcomes[case] = {"error": None}
        except Exception as error:  # noqa: BLE001 - the scenario reports any error
            outcomes[case] = {"type": type(error).__name__, "error": str(error)}
    report({"rank": hf.rank(), "outcomes": outcomes})


if __name__ == "__main__":
    sys.exit(main())
