"""Peak resident memory growth of each rank over building, compiling and one epoch of hf.fit of
a weight-heavy MLP (Adam), as a user would measure it.

Arguments: the layout ("one": one process, plain Keras; "P4": four pipeline stages balanced by
parameters; "R2": two replicas) and "scope" to build under hf.scope() (else an ordinary build).
"""

import keras
import numpy as np

import hyparflow as hf
from hyparflow.memory.resident import PeakGrowth
from tests.support.report import args, report, run_or_abort

WIDTH, DEPTH, SAMPLES, BATCH = 2048, 8, 256, 64  # 8 x 4 M + ... = 34 M parameters


def build():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((WIDTH,))
    x = inputs
    for _ in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


STRATEGIES = {
    "one": "auto",
    "P4": hf.Strategy("model", partitions=4, balance="params"),
    "R2": hf.Strategy("data", replicas=2),
}


def main():
    layout, build_mode = args()
    x = np.random.default_rng(0).normal(size=(SAMPLES, WIDTH)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, SAMPLES)
    optimizer = keras.optimizers.Adam(1e-4)
    with PeakGrowth() as growth:
        if build_mode == "scope":
            with hf.scope():
                model = build()
        else:
            model = build()
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = hf.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                         strategy=STRATEGIES[layout])  # fmt: skip
    report({
        "growth_mib": growth.mib,
        "exact_peak": growth.exact,
        "params": model.count_params(),
        "loss": history.history["loss"],
    })  # fmt: skip


if __name__ == "__main__":
    run_or_abort(main)
