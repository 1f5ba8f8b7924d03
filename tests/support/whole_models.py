"""Models with layers that tensor=2 cannot split, which it keeps whole on every tensor rank.

`odd_mlp` isolates the rule with Keras layers: split Dense pairs before and after a pair of
5 units (kept whole, a Dropout between) and a table of 41 rows (kept whole), so the whole
layers sit between Megatron's g of one split pair and f of the next. `vit` is issue 62's
ViT, whose 17-row position table is kept whole while its attention splits by heads.
"""

import keras
import numpy as np

from tests.support.models import seeded_build
from tests.support.zoo import optimizer

ROWS, LENGTH = 41, 6  # a vocabulary that 2 does not divide


def odd_mlp():
    layers = keras.layers
    tokens = keras.Input((LENGTH,), dtype="int32")
    x = layers.Embedding(ROWS, 8, name="table")(tokens)  # 41 rows: whole
    x = layers.Dense(16, activation="gelu", name="up")(x)  # a split pair
    x = layers.Dense(8, name="down")(x)
    x = layers.LayerNormalization(name="norm")(x)
    x = layers.Dense(5, activation="relu", name="narrow")(x)  # 5 units: the pair stays whole
    x = layers.Dropout(0.2, name="dropout")(x)
    x = layers.Dense(8, name="widen")(x)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    x = layers.Dense(12, activation="tanh", name="head_up")(x)  # a split pair
    outputs = layers.Dense(3, activation="softmax", name="head_down")(x)
    return keras.Model(tokens, outputs, name="odd_mlp")


def vit():
    import keras_hub  # installed apart; imported where used (tests/support/zoo.py)

    backbone = keras_hub.models.ViTBackbone(
        image_shape=(32, 32, 3),
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
    )
    return keras_hub.models.ViTImageClassifier(backbone, num_classes=3, preprocessor=None)


BUILDERS = {"odd_mlp": odd_mlp, "vit": vit}
FROM_LOGITS = {"odd_mlp": False, "vit": True}


def data(name: str, n: int = 70, seed: int = 0):
    """Inputs and labels of 3 classes for model `name` (the same on every rank)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, size=n)
    if name == "vit":
        return rng.normal(size=(n, 32, 32, 3)).astype("float32"), labels
    return rng.integers(0, ROWS, size=(n, LENGTH)).astype("int32"), labels


def compiled(name: str, optimizer_spec: str):
    """Model `name` built with seeded weights and compiled with `optimizer_spec` (zoo's names)."""
    model = seeded_build(BUILDERS[name])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=FROM_LOGITS[name])
    model.compile(optimizer=optimizer(optimizer_spec), loss=loss, metrics=["accuracy"])
    return model
