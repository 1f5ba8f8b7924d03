"""Compiled models named as `module:function` for `hyparflow plan --auto --measure`'s test, and a
saved costs file of uniform layers for the commands that read one."""

import keras

from hyparflow.simulate.costs import Affine, LayerCost, ModelCosts


def tiny_mlp():
    """Four Dense layers (two column/row pairs for T = 2), Adam, sparse cross-entropy."""
    inputs = keras.Input((16,))
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = keras.layers.Dense(64, activation="relu")(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(4, activation="softmax")(x)
    model = keras.Model(inputs, outputs, name="tiny_mlp")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def save_uniform_costs(path) -> None:
    """Write the costs of four equal layers (no machine timed them) as `plan --costs` reads
    them: a forward of 0.1 ms and a backward of 0.2 ms per sample, 4 kB of weights, 1 kB
    activations between layers."""
    ModelCosts(
        name="uniform",
        layers=[
            LayerCost(f"l{i}", Affine(0.0, 1e-4), Affine(0.0, 2e-4), 4000, 2) for i in range(4)
        ],
        cut_bytes=[0.0, 1000.0, 1000.0, 1000.0, 0.0],
    ).save(path)
