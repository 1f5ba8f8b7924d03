"""hf.export's memory: train a weight-heavy model one step with a Checkpoint (one process), then,
in a fresh process, export it and report how far resident memory grew.

Arguments: "train" or "export", then the checkpoint folder (export: and the output path).
"""

import json
import sys

import keras
import numpy as np

import hyparflow as hf
from hyparflow.memory.resident import PeakGrowth

WIDTH, DEPTH = 4096, 8  # 8 x 64 MiB kernels


def build():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((WIDTH,))
    x = inputs
    for _ in range(DEPTH):
        x = keras.layers.Dense(WIDTH)(x)
    return keras.Model(inputs, x)


def main():
    mode, folder = sys.argv[1], sys.argv[2]
    if mode == "train":
        model = build()
        model.compile(keras.optimizers.SGD(1e-3), "mse")
        x = np.ones((8, WIDTH), "float32")
        hf.fit(
            model,
            x,
            x,
            batch_size=8,
            epochs=1,
            verbose=0,
            callbacks=[hf.callbacks.Checkpoint(folder)],
        )
        np.save(folder + "/last_kernel.npy", model.weights[-2].numpy())
        print(json.dumps({"bytes": sum(v.numpy().nbytes for v in model.weights)}))
    else:
        with PeakGrowth() as growth:
            hf.export(folder, sys.argv[3])
        print(json.dumps({"growth": growth.bytes}))


if __name__ == "__main__":
    main()
