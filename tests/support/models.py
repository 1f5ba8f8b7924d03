"""Tiny models covering the graph kinds the engine must train exactly like Keras."""

import keras
import numpy as np

FEATURES = 6


def mlp():
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(8, activation="tanh")(inputs)
    x = keras.layers.Dense(8, activation="relu")(x)
    x = keras.layers.Dense(6, activation="tanh")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="mlp")


def sequential():
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(6, activation="tanh"),
            keras.layers.Dense(3, activation="softmax"),
        ],
        name="sequential",
    )


def l2_mlp():
    reg = keras.regularizers.L2(0.01)
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(8, activation="tanh", kernel_regularizer=reg)(inputs)
    x = keras.layers.Dense(8, activation="relu", bias_regularizer=reg)(x)
    x = keras.layers.Dense(6, activation="tanh", kernel_regularizer=reg)(x)
    outputs = keras.layers.Dense(3, activation="softmax", kernel_regularizer=reg)(x)
    return keras.Model(inputs, outputs, name="l2_mlp")


def cnn():
    inputs = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(6, 3, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="cnn")


def resnet():
    """Skip connections that cross stage boundaries for any 2..4-way split."""
    inputs = keras.Input((FEATURES,))
    stem = keras.layers.Dense(8, activation="relu")(inputs)
    x = stem
    for _ in range(3):
        h = keras.layers.Dense(8, activation="relu")(x)
        h = keras.layers.Dense(8)(h)
        x = keras.layers.Activation("relu")(keras.layers.Add()([x, h]))
    x = keras.layers.Concatenate()([x, stem])  # long skip from the stem to the end
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="resnet")


def multi_io():
    """Two inputs (one used only late), two outputs, two losses with loss weights."""
    a = keras.Input((FEATURES,), name="a")
    b = keras.Input((3,), name="b")
    x = keras.layers.Dense(8, activation="relu")(a)
    x = keras.layers.Dense(8, activation="relu")(x)
    early = keras.layers.Dense(1, name="regression")(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    x = keras.layers.Concatenate()([x, b])
    x = keras.layers.Dense(8, activation="relu")(x)
    late = keras.layers.Dense(3, activation="softmax", name="classes")(x)
    return keras.Model({"a": a, "b": b}, {"regression": early, "classes": late}, name="multi_io")


def shared():
    """One Dense layer called near the start and again near the end (tied weights)."""
    tied = keras.layers.Dense(8, activation="tanh", name="tied")
    inputs = keras.Input((8,))
    x = tied(inputs)
    x = keras.layers.Dense(8, activation="relu")(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    x = tied(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="shared")


def batchnorm():
    # No bias before BatchNormalization: its true gradient is zero, and Adam would turn the
    # float noise in it into full-size steps that no two implementations share.
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(8, use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Dense(8, use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="batchnorm")


def embedding():
    """A token table (row-sparse gradients) in front of dense layers."""
    tokens = keras.Input((FEATURES,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 4)(tokens))
    x = keras.layers.Dense(8, activation="tanh")(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(tokens, outputs, name="embedding")


BUILDERS = {
    f.__name__: f
    for f in (mlp, sequential, l2_mlp, cnn, resnet, multi_io, shared, batchnorm, embedding)
}
VOCAB = 30


def data(name: str, n: int = 70, seed: int = 0):
    """Inputs and targets for model `name` (the same on every rank)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, size=n)
    if name == "cnn":
        return rng.normal(size=(n, 8, 8, 2)).astype("float32"), labels
    if name == "shared":
        return rng.normal(size=(n, 8)).astype("float32"), labels
    if name == "embedding":
        return rng.integers(0, VOCAB, size=(n, FEATURES)).astype("int32"), labels
    if name == "multi_io":
        x = {
            "a": rng.normal(size=(n, FEATURES)).astype("float32"),
            "b": rng.normal(size=(n, 3)).astype("float32"),
        }
        y = {"regression": rng.normal(size=(n, 1)).astype("float32"), "classes": labels}
        return x, y
    return rng.normal(size=(n, FEATURES)).astype("float32"), labels


def sample_weights(n: int) -> np.ndarray:
    """Per-sample weights between 0.5 and 2, the same on every rank."""
    return np.random.default_rng(5).uniform(0.5, 2.0, n).astype("float32")


def seeded_build(builder, policy: str = "float32"):
    """`builder()` with weights fixed by a seed, under the Keras dtype `policy`."""
    keras.utils.set_random_seed(1234)
    keras.config.set_dtype_policy(policy)
    try:
        return builder()
    finally:
        keras.config.set_dtype_policy("float32")


def compiled(name: str, optimizer: str, policy: str = "float32"):
    """A freshly built, compiled model with weights fixed by a seed, built under the Keras
    dtype `policy` ("mixed_float16": float16 compute and activations, float32 weights, dynamic
    loss scaling)."""
    model = seeded_build(BUILDERS[name], policy)
    opt = {
        "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
        # a learning-rate schedule: every stage must step it identically
        "schedule": lambda: keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5),
            momentum=0.5,
        ),
    }[optimizer]()
    if name == "multi_io":
        model.compile(
            optimizer=opt,
            loss={"regression": "mse", "classes": "sparse_categorical_crossentropy"},
            loss_weights={"regression": 0.5, "classes": 2.0},
            metrics={"classes": ["accuracy"]},
        )
    else:
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
