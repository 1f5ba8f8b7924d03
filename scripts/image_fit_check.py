"""A small hf.fit that `make image-test` binds into the image at run time (never built into it).

Run it on any number of ranks, inside the image or outside: rank 0 prints the Python and the
hyparflow it ran with, then `final loss: X` (all digits, to compare the runs exactly).
"""

import sys

import keras
import numpy as np

import hyparflow as hf


def main():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, "relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = hf.fit(model, x, y, batch_size=32, epochs=3, strategy="data", verbose=0)
    if hf.rank() == 0:
        print(f"python {sys.executable}, hyparflow {hf.__file__}, {hf.size()} rank(s)")
        print(f"final loss: {history.history['loss'][-1]!r}")


if __name__ == "__main__":
    main()
