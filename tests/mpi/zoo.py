"""Models users train, built tiny: embeddings, random layers, added losses, library models.

Each builder returns an uncompiled model; `data(name)` gives inputs and targets that are the
same on every rank; `compiled(name, optimizer)` builds and compiles with weights fixed by a
seed. Optimizer names are Keras's own class names, lower-cased ("adamw", "adafactor", ...),
optionally with a clipping suffix: "+clipnorm", "+globalclip" or "+clipvalue".
"""

import keras
import numpy as np

VOCAB, LENGTH = 40, 6


def embedding_mlp():
    """Token lookups (row-sparse gradients) feeding dense layers."""
    tokens = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8)(tokens)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(8, activation="tanh")(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(tokens, outputs, name="embedding_mlp")


def two_tables():
    """Two tables, one looked up twice (its row slices from two calls are concatenated)."""
    words = keras.Input((LENGTH,), dtype="int32", name="words")
    tags = keras.Input((2,), dtype="int32", name="tags")
    word_table = keras.layers.Embedding(VOCAB, 6, name="words_table")
    x = keras.layers.Flatten()(word_table(words))
    again = keras.layers.Flatten()(word_table(tags))
    t = keras.layers.Flatten()(keras.layers.Embedding(7, 3, name="tag_table")(tags))
    x = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([x, again, t]))
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model({"words": words, "tags": tags}, outputs, name="two_tables")


BUILDERS = {f.__name__: f for f in (embedding_mlp, two_tables)}


def data(name: str, n: int = 70, seed: int = 0):
    """Inputs and targets for model `name` (the same on every rank)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, size=n)
    tokens = rng.integers(0, VOCAB, size=(n, LENGTH)).astype("int32")
    if name == "two_tables":
        return {"words": tokens, "tags": rng.integers(0, 7, size=(n, 2)).astype("int32")}, labels
    return tokens, labels


def optimizer(spec: str):
    """A Keras optimizer from "name[+clipping]", e.g. "adam+globalclip"."""
    name, _, clipping = spec.partition("+")
    options = {
        "": {},
        "clipnorm": {"clipnorm": 0.05},
        "globalclip": {"global_clipnorm": 0.05},
        "clipvalue": {"clipvalue": 0.005},
    }[clipping]
    classes = {
        cls.__name__.lower(): cls
        for cls in (
            keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW,
            keras.optimizers.Adadelta, keras.optimizers.Adafactor, keras.optimizers.Adagrad,
            keras.optimizers.Adamax, keras.optimizers.Ftrl, keras.optimizers.Lamb,
            keras.optimizers.Lion, keras.optimizers.Nadam, keras.optimizers.RMSprop,
        )
    }  # fmt: skip
    rates = {"sgd": 0.1, "adadelta": 1.0, "ftrl": 0.1, "adagrad": 0.1}
    return classes[name](learning_rate=rates.get(name, 0.01), **options)


def compiled(name: str, optimizer_spec: str):
    """A freshly built, compiled model with weights fixed by a seed."""
    keras.utils.set_random_seed(1234)
    model = BUILDERS[name]()
    model.compile(
        optimizer=optimizer(optimizer_spec),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model
