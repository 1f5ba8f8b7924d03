"""Demo: hybrid-parallel training of a small ResNet-style classifier with hf.fit.

Run as `mpirun -np 4 python examples/demo.py` (what `make demo` does): 2 pipeline stages x 2
replicas, 4 micro-batches per replica, 1F1B schedule. It prints loss, accuracy and samples/s.
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
    strategy = hf.Strategy("hybrid", partitions=2, replicas=2, microbatches=4, schedule="1f1b")
    if hf.size() != 4:
        strategy = "auto"  # run anywhere; `make demo` launches the 2 x 2 hybrid on 4 ranks
    history = hf.fit(
        model, x, y, batch_size=batch_size, epochs=epochs, verbose=0, strategy=strategy
    )
    elapsed = time.perf_counter() - start
    if hf.rank() == 0:
        for epoch, (loss, acc) in enumerate(
            zip(history.history["loss"], history.history["accuracy"]), 1
        ):
            print(f"epoch {epoch}: loss {loss:.4f}  accuracy {acc:.4f}")
        print(f"{hf.size()} rank(s), {strategy}: {epochs * len(x) / elapsed:.0f} samples/s")


if __name__ == "__main__":
    main()
