"""Models users train, built tiny: embeddings, random layers, added losses, library models.

Each builder returns an uncompiled model; `data(name)` gives inputs and targets that are the
same on every rank; `compiled(name, optimizer)` builds and compiles with weights fixed by a
seed. Optimizer names are Keras's own class names, lower-cased ("adamw", "adafactor", ...),
optionally with a clipping suffix: "+clipnorm", "+globalclip" or "+clipvalue".
"""

import keras
import numpy as np
import tensorflow as tf

from tests.support.models import seeded_build

VOCAB, LENGTH = 40, 6
# keras_hub is imported inside its models' builders: it is installed apart (Makefile), and
# importing it costs each rank of a launch that trains none of its models about half a second.


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


def dropout_mlp():
    """Dropout on features and on a (batch, 1, features)-shaped noise."""
    inputs = keras.Input((4, 6))
    x = keras.layers.Dense(8, activation="tanh")(inputs)
    x = keras.layers.Dropout(0.3, noise_shape=(None, 1, 8))(x)
    x = keras.layers.Flatten()(keras.layers.Dense(8, activation="relu")(x))
    x = keras.layers.Dropout(0.5)(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="dropout_mlp")


@keras.saving.register_keras_serializable(package="zoo")
class ActivationPenalty(keras.layers.Layer):
    """Adds the batch mean of its input's squares as a loss (the usual add_loss form)."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.sum(keras.ops.square(x), axis=-1)))
        return x


def added_losses():
    """`add_loss` in a custom layer early on and an activity regularizer late."""
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="tanh")(inputs)
    x = ActivationPenalty()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    x = keras.layers.Dense(8, activation="tanh", activity_regularizer="l2")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="added_losses")


@keras.saving.register_keras_serializable(package="zoo")
class GlobalCentering(keras.layers.Layer):
    """Centres its input on the mean of the global batch (`hf.global_mean`) and adds that
    mean's squared norm as a loss: both nonlinear in the batch, so a replica's own rows would
    give another value and gradient."""

    def call(self, x):
        import hyparflow as hf

        mean = hf.global_mean(x)
        self.add_loss(0.5 * keras.ops.sum(keras.ops.square(mean)))
        return x - mean


def global_centered():
    """A layer that takes a statistic of the whole global batch with `hf.global_mean`. Train
    it with "adam+epsilon": under the zoo's SGD, Keras alone turns a 1e-7 nudge of its weights
    into 0.09 (relative) in 2 epochs; under Adam's default epsilon hyparflow's 2 replicas
    ended 3.7e-4 from Keras on an AMD EPYC without AVX-512 (a gradient near zero, its rounding
    made steps), 1.3e-6 with epsilon 1e-3."""
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="tanh")(inputs)
    x = GlobalCentering()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="global_centered")


@keras.saving.register_keras_serializable(package="zoo")
class RelativeMixing(keras.layers.Layer):
    """Attention over positions with a learned bias per relative distance, gathered from a
    plain variable with the same indices for every sample, duplicates included (T5's and
    Swin's relative position tables): its gradient is row slices looked up once per batch."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=(2 * input_shape[1] - 1,), name="relative_bias")

    def call(self, x):
        length = keras.ops.shape(x)[1]
        positions = keras.ops.arange(length)
        distance = positions[None, :] - positions[:, None] + length - 1
        bias = keras.ops.take(self.table, distance, axis=0)  # axis=None would reshape: dense
        scores = keras.ops.einsum("bif,bjf->bij", x, x) + bias
        return keras.ops.einsum("bij,bjf->bif", keras.ops.softmax(scores), x)


@keras.saving.register_keras_serializable(package="zoo")
class BroadcastPositions(keras.layers.Layer):
    """Adds a learned vector per position, looked up with ids of shape (1, length) and
    broadcast over the batch, as keras_hub's ViT and PaliGemma encoders do."""

    def __init__(self, length: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.length, self.width = length, width
        self.table = keras.layers.Embedding(length, width, name="position_table")

    def call(self, x):
        return x + self.table(keras.ops.arange(self.length)[None, :])

    def get_config(self):
        return {**super().get_config(), "length": self.length, "width": self.width}


def broadcast_tables():
    """Row-sparse gradients of both kinds: token ids looked up per sample, and position ids of
    shape (1, length) looked up once and broadcast over the batch (keras_hub's ViT), beside a
    plain variable gathered by relative distance (`RelativeMixing`)."""
    tokens = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8, name="token_table")(tokens)
    x = BroadcastPositions(LENGTH, 8, name="broadcast_positions")(x)
    x = keras.layers.Dense(8, activation="tanh")(x)
    x = RelativeMixing(name="relative_mixing")(x)
    x = keras.layers.Flatten()(keras.layers.Dense(8, activation="relu")(x))
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(tokens, outputs, name="broadcast_tables")


def masked_gru():
    """Padding masked by the embedding and read by a GRU further on."""
    tokens = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens)
    x = keras.layers.Dense(8, activation="tanh")(x)
    x = keras.layers.GRU(8)(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(tokens, outputs, name="masked_gru")


def batchnorm_cnn():
    """Convolutions with BatchNormalization, one of them Keras's synchronized kind."""
    inputs = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(x))
    x = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(synchronized=True)(x)
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.Activation("relu")(x))
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="batchnorm_cnn")


def mobilenet_v3():
    """keras.applications' MobileNetV3Small, tiny input: BatchNormalization, hard-swish, SE."""
    return keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3),
        alpha=0.75,
        minimalistic=True,
        weights=None,
        classes=3,
        include_preprocessing=False,
        dropout_rate=0.0,
    )


HUB_VOCAB = 50
# The sizes the tiny keras_hub models share; a builder spells out only what differs
TINY_HUB = {"vocabulary_size": HUB_VOCAB, "num_layers": 2, "hidden_dim": 16}
# encoders, GPT-2 and OPT: two heads over learned positions
TINY_ENCODER = dict(TINY_HUB, num_heads=2, intermediate_dim=32, max_sequence_length=16)
# Llama-style decoders: grouped-query attention, four query heads over two key-value heads
TINY_GQA = dict(TINY_HUB, num_query_heads=4, num_key_value_heads=2, intermediate_dim=32)
# the mixtures: top-2 routing over 4 experts, two query heads (tests/test_moe_dispatch.py
# builds one-layer blocks of the same shapes)
TINY_MIXTURE = dict(TINY_HUB, num_query_heads=2, num_experts=4, top_k=2)
MIXTRAL = dict(TINY_MIXTURE, num_key_value_heads=1, intermediate_dim=8)
QWEN3_MOE = dict(TINY_MIXTURE, intermediate_dim=32, moe_intermediate_dim=8, head_dim=8)
QWEN_MOE = dict(
    TINY_MIXTURE,
    num_key_value_heads=1,
    intermediate_dim=32,
    moe_intermediate_dim=8,
    shared_expert_intermediate_dim=12,
)
QWEN3_5_MOE = dict(
    TINY_MIXTURE,
    num_key_value_heads=1,
    head_dim=8,
    moe_intermediate_dim=8,
    shared_expert_intermediate_size=12,
    layer_types=["full_attention", "full_attention"],
)
GPT_OSS = dict(MIXTRAL, head_dim=8)
RWKV7_LORAS = ("gate_lora", "mv_lora", "aaa_lora", "decay_lora")


def _keras_hub(family: str, sizes: dict, task: str = "CausalLM", **more_sizes):
    """keras_hub's `family` `task` model (e.g. "GPT2", "CausalLM"), tiny: its backbone built
    with `sizes` and `more_sizes` (these win), no preprocessor (the data are token ids already),
    3 classes for a classifier."""
    import keras_hub

    backbone = getattr(keras_hub.models, f"{family}Backbone")(**dict(sizes, **more_sizes))
    classes = {"num_classes": 3} if task == "TextClassifier" else {}
    return getattr(keras_hub.models, family + task)(backbone, preprocessor=None, **classes)


def gpt2():
    """keras_hub's GPT-2 language model, tiny: tied input/output embedding, dropout 0.1."""
    return _keras_hub("GPT2", TINY_ENCODER)


def bert():
    """keras_hub's BERT classifier, tiny: segment and position embeddings, dropout 0.1."""
    return _keras_hub("Bert", TINY_ENCODER, "TextClassifier")


def llama():
    """keras_hub's Llama decoder, tiny: grouped-query attention, rotary embeddings, untied."""
    return _keras_hub("Llama", TINY_GQA)


def gemma():
    """keras_hub's Gemma decoder, tiny: multi-query attention, RMSNorm, tied embedding."""
    return _keras_hub("Gemma", TINY_GQA, num_query_heads=2, num_key_value_heads=1, head_dim=8)


def mistral():
    """keras_hub's Mistral decoder, tiny: grouped-query and sliding-window attention."""
    return _keras_hub("Mistral", TINY_GQA, sliding_window=4)


def opt():
    """keras_hub's OPT decoder, tiny: learned positions, tied embedding, dropout 0.1."""
    return _keras_hub("OPT", TINY_ENCODER)


def distil_bert():
    """keras_hub's DistilBERT classifier, tiny (no segment ids), dropout 0.1."""
    return _keras_hub("DistilBert", TINY_ENCODER, "TextClassifier")


def roberta():
    """keras_hub's RoBERTa classifier, tiny, dropout 0.1."""
    return _keras_hub("Roberta", TINY_ENCODER, "TextClassifier")


def albert():
    """keras_hub's ALBERT classifier, tiny: one transformer layer reused at every depth (a
    layer shared by every pipeline stage) and factorised embeddings."""
    return _keras_hub("Albert", TINY_ENCODER, "TextClassifier", num_layers=3, embedding_dim=8)


def falcon():
    """keras_hub's Falcon decoder, tiny: ALiBi attention biases, feed-forward dropout 0.1."""
    return _keras_hub(
        "Falcon", TINY_HUB, num_attention_heads=2, intermediate_dim=32, feedforward_dropout_rate=0.1
    )


def qwen3_moe():
    """keras_hub's Qwen3 mixture of experts, tiny: top-2 routing over 4 experts, its router's
    load-balancing loss on (0.1): summed over replicas in the step, and over micro-batches
    once all have run forward (GPipe; moe/router_tally.py). Two key-value heads: tensor=2
    splits its attention."""
    return _keras_hub("Qwen3Moe", QWEN3_MOE, num_key_value_heads=2, router_aux_loss_coefficient=0.1)


def qwen_moe():
    """keras_hub's Qwen-MoE (Qwen1.5/2), tiny: top-2 of 4 experts beside a shared expert that
    every token goes through (sigmoid-gated), router loss on (0.1)."""
    return _keras_hub("QwenMoe", QWEN_MOE, router_aux_loss_coefficient=0.1)


def qwen3_5_moe():
    """keras_hub's Qwen3.5-MoE, tiny: two full-attention layers (partial rotary embeddings, gated
    queries), each with top-2 of 4 experts beside a shared expert; router loss on (0.1). Its
    linear-attention layers (gated delta rule) fail in Keras's own compiled fit on TensorFlow
    when the sequence length is unknown (a symbolic tensor used as a Python bool), so none here."""
    return _keras_hub("Qwen3_5Moe", QWEN3_5_MOE, router_aux_loss_coefficient=0.1)


def mixtral():
    """keras_hub's Mixtral, tiny: top-2 routing over 4 experts, each computed sparsely by
    hyparflow (its dense experts in Keras), and its router's load-balancing loss on (0.1, five
    times keras_hub's default): hyparflow sums the routing counts over the replicas."""
    return _keras_hub("Mixtral", MIXTRAL, router_aux_loss_coef=0.1)


def gpt_oss():
    """keras_hub's gpt-oss, tiny: top-2 of 4 biased, clamped experts (no router loss), computed
    sparsely by hyparflow; attention sinks and a sliding window; an L2 penalty on its expert
    weights (a split expert kernel's penalty is summed over its expert group)."""
    from hyparflow.moe import expert_weights

    model = _keras_hub("GptOss", GPT_OSS)
    for variable in expert_weights(model):
        variable.regularizer = keras.regularizers.L2(1e-3)
    return model


def preprocessed():
    """Preprocessing layers in the graph: Normalization and Discretization, then dense layers."""
    inputs = keras.Input((6,))
    scaled = keras.layers.Normalization(mean=0.5, variance=4.0)(inputs)
    buckets = keras.layers.Discretization(bin_boundaries=[-1.0, 0.0, 1.0])(inputs)
    encoded = keras.layers.CategoryEncoding(num_tokens=4, output_mode="count")(buckets)
    x = keras.layers.Concatenate()([scaled, encoded])
    x = keras.layers.Dense(8, activation="tanh")(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="preprocessed")


def wide_mlp():
    """Megatron's MLP twice over: Dense pairs that widen then narrow, dropout between, L2."""
    inputs = keras.Input((6,))
    x = inputs
    for width in (16, 12):
        x = keras.layers.Dense(width, activation="gelu", kernel_regularizer="l2")(x)
        x = keras.layers.Dropout(0.3)(x)
        x = keras.layers.Dense(6)(x)
        x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="wide_mlp")


def conv_pairs():
    """Conv2D pairs (output channels, then input channels) through ReLU and pooling, and a
    conv whose channels reach a Dense through global pooling."""
    inputs = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(4, 3, padding="same")(x)
    x = keras.layers.Conv2D(6, 1, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(6, activation="relu")(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="conv_pairs")


def encoder():
    """A Transformer encoder block of Keras layers: MultiHeadAttention with dropout on its
    scores, residuals, LayerNorm, a feed-forward Dense pair; over token embeddings."""
    tokens = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8)(tokens)
    attended = keras.layers.MultiHeadAttention(num_heads=4, key_dim=4, dropout=0.2)(x, x)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attended]))
    h = keras.layers.Dense(16, activation="relu")(x)
    h = keras.layers.Dense(8)(keras.layers.Dropout(0.1)(h))
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, h]))
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(tokens, outputs, name="encoder")


BUILDERS = {
    f.__name__: f
    for f in (
        embedding_mlp,
        two_tables,
        broadcast_tables,
        dropout_mlp,
        added_losses,
        global_centered,
        masked_gru,
        batchnorm_cnn,
        preprocessed,
        mobilenet_v3,
        gpt2,
        bert,
        llama,
        gemma,
        mistral,
        opt,
        distil_bert,
        roberta,
        albert,
        falcon,
        qwen3_moe,
        qwen_moe,
        qwen3_5_moe,
        mixtral,
        gpt_oss,
        wide_mlp,
        conv_pairs,
        encoder,
    )
}
# keras_hub: token batches of varying length; classifiers take labels, the others next tokens
TEXT_MODELS = (
    "gpt2",
    "bert",
    "llama",
    "gemma",
    "mistral",
    "opt",
    "distil_bert",
    "roberta",
    "albert",
    "falcon",
    "qwen3_moe",
    "qwen_moe",
    "qwen3_5_moe",
    "mixtral",
    "gpt_oss",
)
# keras_hub mixtures, dispatched sparsely
MIXTURES = ("qwen3_moe", "qwen_moe", "qwen3_5_moe", "mixtral", "gpt_oss")
CLASSIFIERS = ("bert", "distil_bert", "roberta", "albert")
SEGMENTED = ("bert", "albert")  # take segment ids
TEXT_LENGTHS = (7, 5, 9, 7, 3)  # one sequence length per batch of an epoch


def text_batches(name: str, batch_size: int, seed: int = 0):
    """A tf.data.Dataset of `batch_size` token sequences per batch, each batch its own length
    (padded at the end), the same on every rank. keras_hub's tasks take tf.data in fit."""
    rng = np.random.default_rng(seed)
    batches = []
    for length in TEXT_LENGTHS:
        tokens = rng.integers(1, HUB_VOCAB, size=(batch_size, length)).astype("int32")
        valid = rng.integers(max(1, length - 3), length + 1, size=batch_size)
        mask = (np.arange(length)[None, :] < valid[:, None]).astype("int32")
        x = {"token_ids": tokens * mask, "padding_mask": mask}
        if name in SEGMENTED:
            x["segment_ids"] = np.zeros_like(tokens)
        if name in CLASSIFIERS:
            y = rng.integers(0, 3, size=batch_size).astype("int32")
        else:  # next-token prediction
            y = np.concatenate([tokens[:, 1:], np.zeros((batch_size, 1), "int32")], axis=1)
        batches.append((x, y))
    token = tf.TensorSpec((None, None), tf.int32)
    x_spec = {k: token for k in batches[0][0]}
    y_spec = tf.TensorSpec((None,) if name in CLASSIFIERS else (None, None), tf.int32)
    dataset = tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=(x_spec, y_spec)
    )
    # Known length: without it Keras's fit runs past the end of the first epoch.
    return dataset.apply(tf.data.experimental.assert_cardinality(len(batches)))


def training_data(name: str, one_step: bool = False):
    """What the equivalence scenarios fit model `name` on: (x, y, batch_size, epochs). Text
    models take batches of varying sequence length; the others 70 samples in batches of 16 for
    2 epochs, or one batch for one step (`one_step`: deep networks at tiny sizes amplify float
    noise step by step)."""
    epochs = 1 if one_step else 2
    if name in TEXT_MODELS:
        return text_batches(name, 16), None, None, epochs
    x, y = data(name, n=16 if one_step else 70)
    return x, y, 16, epochs


def data(name: str, n: int = 70, seed: int = 0):
    """Inputs and targets for model `name` (the same on every rank)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, size=n)
    tokens = rng.integers(0, VOCAB, size=(n, LENGTH)).astype("int32")
    if name == "two_tables":
        return {"words": tokens, "tags": rng.integers(0, 7, size=(n, 2)).astype("int32")}, labels
    if name == "masked_gru":  # trailing padding of 0 to 3 tokens
        valid = rng.integers(LENGTH - 3, LENGTH + 1, size=n)
        padded = np.where(np.arange(LENGTH)[None, :] < valid[:, None], tokens % (VOCAB - 1) + 1, 0)
        return padded, labels
    if name == "dropout_mlp":
        return rng.normal(size=(n, 4, 6)).astype("float32"), labels
    if name == "wide_mlp":
        return rng.normal(size=(n, 6)).astype("float32"), labels
    if name in ("batchnorm_cnn", "conv_pairs"):
        return rng.normal(size=(n, 8, 8, 2)).astype("float32"), labels
    if name == "mobilenet_v3":
        return rng.normal(size=(n, 32, 32, 3)).astype("float32"), labels
    if name in ("added_losses", "preprocessed"):
        return rng.normal(size=(n, 6)).astype("float32"), labels
    return tokens, labels


def optimizer(spec: str):
    """A Keras optimizer from "name[@learning_rate][+option]", e.g. "adam+globalclip".

    Every built-in optimizer but ScheduleFreeAdamW, whose `model.fit` in Keras 3.15 starts its
    momentum at zero while its own `optimizer.apply` starts it at the weights (hyparflow does
    the latter, to 2e-7; docs/models.md).
    """
    name, _, clipping = spec.partition("+")
    name, _, rate = name.partition("@")
    options = {
        "": {},
        "clipnorm": {"clipnorm": 0.05},
        "globalclip": {"global_clipnorm": 0.05},
        "clipvalue": {"clipvalue": 0.005},
        "ema": {"use_ema": True},  # fit ends with the weights' moving averages
        # gradients that are zero but for rounding: Adam's default 1e-7 turns that rounding
        # into steps of the learning rate's size, which differ with the CPU's float kernels
        "epsilon": {"epsilon": 1e-3},
    }[clipping]
    classes = {
        cls.__name__.lower(): cls
        for cls in (
            keras.optimizers.SGD,
            keras.optimizers.Adam,
            keras.optimizers.AdamW,
            keras.optimizers.Adadelta,
            keras.optimizers.Adafactor,
            keras.optimizers.Adagrad,
            keras.optimizers.Adamax,
            keras.optimizers.Ftrl,
            keras.optimizers.Lamb,
            keras.optimizers.Lion,
            keras.optimizers.Nadam,
            keras.optimizers.RMSprop,
            keras.optimizers.Muon,
        )
    }
    rates = {"sgd": 0.1, "adadelta": 1.0, "ftrl": 0.1, "adagrad": 0.1}
    if name == "sgd":
        options["momentum"] = 0.9  # state carried across steps, as the adaptive ones have
    rate = float(rate) if rate else rates.get(name, 0.01)
    return classes[name](learning_rate=rate, **options)


def compiled(name: str, optimizer_spec: str, policy: str = "float32"):
    """A freshly built, compiled model with weights fixed by a seed, under the Keras dtype
    `policy` (e.g. "mixed_float16")."""
    model = seeded_build(BUILDERS[name], policy)
    from_logits = name in TEXT_MODELS
    model.compile(
        optimizer=optimizer(optimizer_spec),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits),
        metrics=["accuracy"],
    )
    return model


def rwkv7():
    """keras_hub's RWKV-7, tiny, classifying its tokens' mean logits. Its time mix loops over
    the steps in Python: its step traces only at known lengths (engine/relaxed.py)."""
    import keras_hub

    backbone = keras_hub.models.RWKV7Backbone(
        hidden_size=16,
        head_size=8,
        num_layers=2,
        vocabulary_size=HUB_VOCAB,
        intermediate_dim=32,
        **dict.fromkeys(RWKV7_LORAS, 8),  # every low-rank projection of rank 8
    )
    tokens = keras.Input((None,), dtype="int32", name="token_ids")
    logits = backbone({"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens)})
    pooled = keras.layers.GlobalAveragePooling1D()(logits)
    return keras.Model(tokens, keras.layers.Dense(3, activation="softmax")(pooled), name="rwkv7")


BUILDERS["rwkv7"] = rwkv7
