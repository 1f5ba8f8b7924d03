"""The models the benchmarks train: MLPs of equal layers, CIFAR-style ResNets (He et al.) and a
transformer encoder of dense inputs.

`cifar_resnet(depth)` is the ResNet of He et al. 2016 for 32x32 images, the family of the
HyPar-Flow paper's ResNet-110 (basic blocks, 6n+2 layers: depth 110 = 18 blocks per stage) and
ResNet-1001 (pre-activation bottleneck blocks, 9n+2 layers: depth 1001 = 111 per stage).
"""

from __future__ import annotations


def mlp(
    width: int,
    depth: int,
    inputs: int | None = None,
    classes: int = 10,
    *,
    optimizer="sgd",
    seed: int = 0,
    metrics=None,
):
    """`depth` Dense(width, relu) layers and a softmax; compiled with sparse cross-entropy."""
    import keras

    keras.utils.set_random_seed(seed)
    x = inputs_ = keras.Input((inputs or width,))
    for i in range(depth):
        x = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="classes")(x)
    model = keras.Model(inputs_, outputs, name=f"mlp_{depth}x{width}")
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=metrics)
    return model


def _basic_block(x, width: int, stride: int, name: str):
    from keras import layers

    y = layers.Conv2D(
        width, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_conv1"
    )(x)
    y = layers.BatchNormalization(name=f"{name}_bn1")(y)
    y = layers.Activation("relu", name=f"{name}_relu1")(y)
    y = layers.Conv2D(width, 3, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    y = layers.BatchNormalization(name=f"{name}_bn2")(y)
    if stride != 1 or x.shape[-1] != width:
        x = layers.Conv2D(width, 1, strides=stride, use_bias=False, name=f"{name}_proj")(x)
        x = layers.BatchNormalization(name=f"{name}_proj_bn")(x)
    x = layers.Add(name=f"{name}_add")([x, y])
    return layers.Activation("relu", name=f"{name}_out")(x)


def _bottleneck_block(x, width: int, stride: int, name: str):
    """Pre-activation bottleneck (He et al. 2016, "Identity Mappings"): width -> 4 x width."""
    from keras import layers

    y = layers.BatchNormalization(name=f"{name}_bn1")(x)
    y = layers.Activation("relu", name=f"{name}_relu1")(y)
    if stride != 1 or x.shape[-1] != 4 * width:
        x = layers.Conv2D(4 * width, 1, strides=stride, use_bias=False, name=f"{name}_proj")(y)
    y = layers.Conv2D(width, 1, use_bias=False, name=f"{name}_conv1")(y)
    y = layers.BatchNormalization(name=f"{name}_bn2")(y)
    y = layers.Activation("relu", name=f"{name}_relu2")(y)
    y = layers.Conv2D(
        width, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_conv2"
    )(y)
    y = layers.BatchNormalization(name=f"{name}_bn3")(y)
    y = layers.Activation("relu", name=f"{name}_relu3")(y)
    y = layers.Conv2D(4 * width, 1, use_bias=False, name=f"{name}_conv3")(y)
    return layers.Add(name=f"{name}_add")([x, y])


def cifar_resnet(
    depth: int = 110,
    *,
    image: int = 32,
    classes: int = 10,
    base: int = 16,
    optimizer="sgd",
    seed: int = 0,
    bottleneck: bool | None = None,
):
    """CIFAR ResNet-`depth`: basic blocks when depth = 6n+2 (20, 56, 110), pre-activation
    bottlenecks when depth = 9n+2 (164, 1001) or `bottleneck`. `image` scales the input (32
    is CIFAR).

    Example:
        >>> len(cifar_resnet(20).layers) > 60
        True
    """
    import sys

    import keras
    from keras import layers

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 100_000))  # Keras walks deep graphs
    keras.utils.set_random_seed(seed)
    if bottleneck is None:
        bottleneck = depth >= 164 or (depth - 2) % 6 != 0
    if (depth - 2) % 6 == 0 and not bottleneck:
        blocks, block, widths = (depth - 2) // 6, _basic_block, (base, 2 * base, 4 * base)
    elif (depth - 2) % 9 == 0:
        blocks, block, widths = (depth - 2) // 9, _bottleneck_block, (base, 2 * base, 4 * base)
    else:
        raise ValueError(f"depth {depth} is neither 6n+2 (basic) nor 9n+2 (bottleneck)")
    inputs = keras.Input((image, image, 3), name="images")
    x = layers.Conv2D(base, 3, padding="same", use_bias=False, name="stem")(inputs)
    if block is _basic_block:
        x = layers.BatchNormalization(name="stem_bn")(x)
        x = layers.Activation("relu", name="stem_relu")(x)
    for stage, width in enumerate(widths):
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            x = block(x, width, stride, f"s{stage}b{b}")
    if block is _bottleneck_block:
        x = layers.BatchNormalization(name="final_bn")(x)
        x = layers.Activation("relu", name="final_relu")(x)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(classes, activation="softmax", name="classes")(x)
    model = keras.Model(inputs, outputs, name=f"resnet{depth}")
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model


def transformer(
    width: int, depth: int, *, heads: int = 4, positions: int = 32, classes: int = 10, seed=0
):
    """A transformer encoder over `positions` dense inputs of `width` features: `depth`
    pre-norm blocks (self-attention of `heads` heads, a 4x-wide GELU feed-forward, residuals),
    then mean pooling and a softmax; Adam and sparse cross-entropy. No embedding table, so a
    stage of it can be cut into segments."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((positions, width))
    x = inputs
    for i in range(depth):
        x = encoder_block(x, i, width, heads)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="classes")(x)
    model = keras.Model(inputs, outputs, name=f"transformer_{depth}x{width}")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def subclassed_transformer(
    width: int, depth: int, *, heads: int = 4, positions: int = 32, classes: int = 10, seed=0
):
    """`transformer`'s layers in a subclassed model (no layer graph to cut): its blocks are
    layers of their own, each a unit ZeRO-3 gathers around its call."""
    import keras

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.norm_a = keras.layers.LayerNormalization()
            self.attention = keras.layers.MultiHeadAttention(heads, width // heads)
            self.norm_f = keras.layers.LayerNormalization()
            self.up = keras.layers.Dense(4 * width, activation="gelu")
            self.down = keras.layers.Dense(width)

        def call(self, x):
            h = self.norm_a(x)
            x = x + self.attention(h, h)
            return x + self.down(self.up(self.norm_f(x)))

    class Encoder(keras.Model):
        def __init__(self):
            super().__init__(name=f"subclassed_transformer_{depth}x{width}")
            self.blocks = [Block(name=f"block_{i}") for i in range(depth)]
            self.pool = keras.layers.GlobalAveragePooling1D()
            self.head = keras.layers.Dense(classes, activation="softmax", name="classes")

        def call(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(self.pool(x))

    keras.utils.set_random_seed(seed)
    model = Encoder()
    model(keras.ops.zeros((1, positions, width)))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def synthetic_data(model, samples: int, seed: int = 1):
    """Random inputs of the model's input shape and integer labels for its classes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, *model.input_shape[1:])).astype("float32")
    classes = model.output_shape[-1]
    return x, rng.integers(0, classes, size=samples)


def encoder_block(x, i: int, width: int, heads: int):
    """Block `i` of a pre-norm encoder on `x`: self-attention of `heads` heads and a GELU
    feed-forward of 4 x `width`, each residual."""
    import keras

    h = keras.layers.LayerNormalization(name=f"norm_a{i}")(x)
    h = keras.layers.MultiHeadAttention(heads, width // heads, name=f"attention_{i}")(h, h)
    x = keras.layers.Add(name=f"residual_a{i}")([x, h])
    h = keras.layers.LayerNormalization(name=f"norm_f{i}")(x)
    h = keras.layers.Dense(4 * width, activation="gelu", name=f"up_{i}")(h)
    h = keras.layers.Dense(width, name=f"down_{i}")(h)
    return keras.layers.Add(name=f"residual_f{i}")([x, h])
