"""Demo: hybrid-parallel training of a small ResNet-style classifier with hf.fit.

Run as `hyparflow run -n 4 --oversubscribe examples/demo.py` (what `make demo` does; or plain
`mpirun -np 4 python examples/demo.py`): 2 pipeline stages x 2 replicas, 4 micro-batches per
replica, 1F1B schedule; on any other number of ranks, data parallel. Rank 0 shows Keras's
progress bar, then one line with the layout and the samples per second.
"""

import time

import keras
import numpy as np

import hyparflow as hf


def small_resnet(num_classes: int = 10) -> keras.Model:
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    for _ in range(2):
        skip = x
        x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(x)
        x = keras.layers.Conv2D(16, 3, padding="same")(x)
        x = keras.layers.Activation("relu")(keras.layers.Add()([x, skip]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="small_resnet")


def main():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 16, 16, 3)).astype("float32")
    y = (x[:, :8, :8, 0].mean(axis=(1, 2)) > 0).astype("int64") + 2 * (x[..., 1].mean((1, 2)) > 0)
    model = small_resnet()
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    epochs, batch_size = 5, 64
    start = time.perf_counter()
    # tune_process: `make demo` runs 4 ranks wherever it is, even on 2 cores; the opt-in pins
    # them when ranks outnumber cores (docs/architecture.md, "Process tuning").
    strategy = hf.Strategy(
        "hybrid", partitions=2, replicas=2, microbatches=4, schedule="1f1b", tune_process=True
    )
    if hf.size() != 4:
        strategy = "auto"  # run anywhere; `make demo` launches the 2 x 2 hybrid on 4 ranks
    history = hf.fit(model, x, y, batch_size=batch_size, epochs=epochs, strategy=strategy)
    elapsed = time.perf_counter() - start
    if hf.rank() == 0:
        layout = (
            f"{strategy.partitions} stages x {strategy.replicas} replicas, "
            f"{strategy.microbatches} micro-batches, {strategy.schedule}"
            if isinstance(strategy, hf.Strategy)
            else f"strategy {strategy!r}"
        )
        print(
            f"Trained {epochs} epochs on {hf.size()} ranks ({layout}): "
            f"{epochs * len(x) / elapsed:.0f} samples/s, "
            f"final accuracy {history.history['accuracy'][-1]:.3f}"
        )


if __name__ == "__main__":
    main()
