"""Compiled models named as `module:function` for `hyparflow plan --auto --measure`'s test."""

import keras


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
