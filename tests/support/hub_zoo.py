"""Every keras_hub family that takes token ids, images or audio, built tiny from a table.

`FAMILIES` maps a family (the prefix keras_hub's classes share: "GPT2" for `GPT2Backbone` and
`GPT2CausalLM`) to its backbone's tiny config. The task class is looked up in the installed
keras_hub by that prefix and the first suffix of `TASK_SUFFIXES` it has; a family without one
gets a simple head (its output pooled, then a Dense of `CLASSES` logits). Inputs are made from
the model's own input specs by name (`data`), targets from its output's shape, so a family
needs one line here and nothing else. `compiled(family)` builds with weights fixed by a seed,
`preprocessor=None`, Adam; the same on every rank.

keras_hub is imported inside the builders: it is installed apart (Makefile).
"""

from __future__ import annotations

import keras
import numpy as np

from tests.support.models import seeded_build

VOCAB, LENGTH, CLASSES = 64, 8, 3
SAMPLES, BATCH, EPOCHS = 16, 8, 2  # 4 steps: batches of 8 split into 2 pieces of 4
IMAGE = (32, 32, 3)
TASK_SUFFIXES = (
    "CausalLM",
    "Seq2SeqLM",
    "AudioToText",
    "TextClassifier",
    "ImageClassifier",
    "ProteinClassifier",
)

# The shapes most families share; a row spells out only what differs.
_LAYERS = dict(num_layers=2, hidden_dim=16, intermediate_dim=32)
_TEXT = dict(_LAYERS, vocabulary_size=VOCAB, num_heads=2)
_POSITIONS = dict(_TEXT, max_sequence_length=16)
_GQA = dict(_LAYERS, vocabulary_size=VOCAB, num_query_heads=4, num_key_value_heads=2)
_VIT = dict(image_shape=IMAGE, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16)
# T5Gemma's encoder and decoder: the same sizes, each key named with its side
_T5GEMMA_SIDE = dict(
    _LAYERS,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    layer_types=["full_attention"] * 2,
)
_T5GEMMA = dict(
    vocabulary_size=VOCAB,
    **{f"{side}_{key}": v for side in ("encoder", "decoder") for key, v in _T5GEMMA_SIDE.items()},
)


def _sub(name: str, **config):
    """A sub-model keras_hub's backbone takes as an argument (a vision or text encoder), built
    when the family is."""
    return lambda: _hub_class(name)(**config)


def _dual_encoders(family: str) -> dict:
    """An image and a text encoder of `family` (CLIP's, SigLIP's kinds), the same tiny sizes."""
    shared = dict(_LAYERS, num_heads=2)
    text = dict(_TEXT, embedding_dim=16, max_sequence_length=LENGTH)
    return dict(
        vision_encoder=_sub(f"{family}VisionEncoder", patch_size=8, image_shape=IMAGE, **shared),
        text_encoder=_sub(f"{family}TextEncoder", **text),
    )


FAMILIES = {
    # causal language models
    "GPT2": _POSITIONS,
    "GPTNeoX": _POSITIONS,
    "OPT": _POSITIONS,
    "Bloom": _TEXT,
    "Falcon": dict(_TEXT, num_attention_heads=2, num_heads=None),
    "Llama": _GQA,
    "Llama3": _GQA,
    "Mistral": _GQA,
    "Qwen": _GQA,
    "Phi3": _GQA,
    "Gemma": dict(_GQA, head_dim=4),
    "Gemma3": dict(_GQA, head_dim=4, image_size=16),  # text only: no vision encoder
    "Gemma3n": dict(  # text only: no vision or audio encoder
        text_vocab_size=VOCAB, text_hidden_size=16, num_hidden_layers=2, pad_token_id=0,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=[32, 32],
        hidden_activation="gelu_approximate", layer_types=["sliding_attention", "full_attention"],
        sliding_window=4, rope_theta=10000.0, max_position_embeddings=16,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=4, altup_num_inputs=2,
        laurel_rank=2,
    ),
    "Gemma4": dict(_GQA, head_dim=4, image_size=16, sliding_window_size=4,
                   sliding_window_pattern=2, hidden_size_per_layer_input=4),  # text only
    "Qwen3": dict(_GQA, head_dim=4),
    "Qwen3_5": dict(_GQA, head_dim=4, linear_num_key_heads=2, linear_num_value_heads=2,
                    linear_key_head_dim=4, linear_value_head_dim=4),
    "SmolLM3": dict(_LAYERS, vocabulary_size=VOCAB, num_attention_heads=4, num_key_value_heads=2,
                    attention_bias=False, attention_dropout=0.0, mlp_bias=False,
                    rope_layer_enabled_list=[True, False], layer_types=["attention", "attention"],
                    layer_norm_epsilon=1e-6, max_position_embeddings=32, rope_theta=10000.0,
                    partial_rotary_factor=1.0),
    "Mixtral": dict(_GQA, intermediate_dim=8, num_experts=4, top_k=2),
    "QwenMoe": dict(_GQA, moe_intermediate_dim=8, shared_expert_intermediate_dim=12,
                    num_experts=4, top_k=2),
    "Qwen3Moe": dict(_GQA, head_dim=4, moe_intermediate_dim=8, num_experts=4, top_k=2),
    "Qwen3_5Moe": dict(_GQA, head_dim=8, moe_intermediate_dim=8,
                       shared_expert_intermediate_size=12, num_experts=4, top_k=2,
                       layer_types=["full_attention", "full_attention"], intermediate_dim=None),
    "GptOss": dict(_GQA, intermediate_dim=8, num_experts=4, top_k=2, head_dim=4),
    "RWKV7": dict(hidden_size=16, head_size=8, num_layers=2, vocabulary_size=VOCAB,
                  intermediate_dim=32, gate_lora=8, mv_lora=8, aaa_lora=8, decay_lora=8),
    # encoders and text classifiers
    "Bert": _POSITIONS,
    "Roberta": _POSITIONS,
    "XLMRoberta": _POSITIONS,
    "DistilBert": _POSITIONS,
    "Albert": dict(_POSITIONS, embedding_dim=8),
    "DebertaV3": dict(_TEXT, max_sequence_length=16, bucket_size=4),
    "FNet": dict(_POSITIONS, num_heads=None),
    "RoformerV2": dict(_TEXT, head_size=8),
    "Electra": dict(_POSITIONS, vocabulary_size=None, vocab_size=VOCAB, embedding_dim=8),
    "XLNet": _TEXT,
    "ESM": _POSITIONS,
    # sequence to sequence
    "Bart": _POSITIONS,
    "T5": dict(_TEXT, key_value_dim=8),
    "T5Gemma": _T5GEMMA,
    "T5Gemma2": _T5GEMMA,  # text only: no vision encoder
    "EdRec": dict(vocab_size=VOCAB, num_layers_enc=2, num_layers_dec=2, hidden_dim=16,
                  intermediate_dim=32, num_heads=2),
    # audio
    "Whisper": dict(_TEXT, num_mels=8, max_encoder_sequence_length=16,
                    max_decoder_sequence_length=16),
    "Moonshine": dict(vocabulary_size=VOCAB, filter_dim=16, encoder_num_layers=2,
                      decoder_num_layers=2, hidden_dim=16, intermediate_dim=32,
                      encoder_num_heads=2, decoder_num_heads=2),
    # vision
    "ViT": dict(_VIT, mlp_dim=32),
    "DeiT": dict(_VIT, intermediate_dim=32),
    "DINOV2": dict(patch_size=8, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32,
                   image_shape=IMAGE, position_embedding_shape=(32, 32)),
    "DINOV3": dict(patch_size=8, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32,
                   image_shape=IMAGE),
    # keras_hub's default stochastic depth (drop_path=0.1): its blocks after the first draw
    "SwinTransformer": dict(image_shape=IMAGE, patch_size=2, embed_dim=8, depths=(1, 1),
                            num_heads=(2, 2), window_size=4),
    "ResNet": dict(input_conv_filters=[64], input_conv_kernel_sizes=[3],
                   stackwise_num_filters=[64, 8], stackwise_num_blocks=[1, 1],  # 64: keras_hub
                   stackwise_num_strides=[1, 2], block_type="basic_block", image_shape=IMAGE),
    "VGG": dict(stackwise_num_repeats=[1, 1], stackwise_num_filters=[8, 8], image_shape=IMAGE),
    "DenseNet": dict(stackwise_num_repeats=[1, 1], growth_rate=4, image_shape=IMAGE),
    "EfficientNet": dict(
        stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1],
        stackwise_input_filters=[8, 8], stackwise_output_filters=[8, 16],
        stackwise_expansion_ratios=[1, 2], stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
        stackwise_strides=[1, 2], stackwise_block_types=["fused", "unfused"],
        width_coefficient=1.0, depth_coefficient=1.0, image_shape=IMAGE,
    ),
    "MobileNet": dict(
        stackwise_expansion=[[16], [24, 24]], stackwise_num_blocks=[1, 2],
        stackwise_num_filters=[[8], [16, 16]], stackwise_kernel_size=[[3], [3, 3]],
        stackwise_num_strides=[[2], [2, 1]], stackwise_se_ratio=[[None], [0.25, 0.25]],
        stackwise_activation=[["relu"], ["hard_swish", "hard_swish"]],
        stackwise_padding=[[1], [1, 1]], output_num_filters=32, depthwise_filters=8,
        depthwise_stride=2, depthwise_residual=False, last_layer_filter=32,
        input_num_filters=8, image_shape=IMAGE,
    ),
    "CSPNet": dict(stem_filters=8, stem_kernel_size=3, stem_strides=1, stackwise_depth=[1, 1],
                   stackwise_strides=[1, 2], stackwise_num_filters=[8, 16], stage_type="dark",
                   block_type="dark_block", image_shape=IMAGE),
    "HGNetV2": dict(
        depths=[1, 1], embedding_size=8, hidden_sizes=[16, 32], stem_channels=[3, 8, 8],
        hidden_act="relu", use_learnable_affine_block=False,
        stackwise_stage_filters=[(8, 8, 16, 1, 1, 3), (16, 8, 32, 1, 1, 3)],
        apply_downsample=[False, True], use_lightweight_conv_block=[False, False],
        image_shape=IMAGE,
    ),
    "MiT": dict(layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2],
                layerwise_sr_ratios=[4, 2], max_drop_path_rate=0.1, layerwise_patch_sizes=[7, 3],
                layerwise_strides=[4, 2], hidden_dims=[8, 16], image_shape=IMAGE),
    "ViTDet": dict(hidden_size=16, num_layers=2, intermediate_dim=32, num_heads=2,
                   global_attention_layer_indices=[1], image_shape=IMAGE, patch_size=8,
                   num_output_channels=8, window_size=2),
    "MobileNetV5": dict(  # convert_arch_def_to_stackwise([["er_r1_k3_s2_e2_c8"],
        # ["uir_r1_a3_k3_s2_e2_c16", "mqa_r1_k3_h2_v2_s1_d8_c16"]])
        stackwise_block_types=[["er"], ["uir", "mqa"]], stackwise_num_blocks=[1, 2],
        stackwise_num_filters=[[8], [16, 16]], stackwise_strides=[[2], [2, 1]],
        stackwise_act_layers=[["gelu"], ["gelu", "gelu"]],
        stackwise_exp_ratios=[[2.0], [2.0, 0.0]], stackwise_se_ratios=[[0.0], [0.0, 0.0]],
        stackwise_dw_kernel_sizes=[[0], [3, 0]], stackwise_dw_start_kernel_sizes=[[0], [3, 0]],
        stackwise_dw_end_kernel_sizes=[[0], [0, 0]], stackwise_exp_kernel_sizes=[[3], [0, 0]],
        stackwise_pw_kernel_sizes=[[1], [0, 0]], stackwise_num_heads=[[0], [0, 2]],
        stackwise_key_dims=[[0], [0, 8]], stackwise_value_dims=[[0], [0, 8]],
        stackwise_kv_strides=[[0], [0, 2]], stackwise_use_cpe=[[False], [False, False]],
        stem_size=8, num_features=16, msfa_output_resolution=4, image_shape=IMAGE,
    ),
    "Xception": dict(stackwise_conv_filters=[[8, 8], [8, 8]], stackwise_pooling=[True, False],
                     image_shape=IMAGE),
    # image and text
    "PaliGemma": dict(
        vocabulary_size=VOCAB, image_size=16, num_layers=2, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=8, intermediate_dim=16, head_dim=4, vit_patch_size=4,
        vit_num_layers=2, vit_num_heads=2, vit_hidden_dim=8, vit_intermediate_dim=16,
    ),
    "CLIP": dict(_dual_encoders("CLIP"), projection_dim=16),
    "SigLIP": _dual_encoders("SigLIP"),
    "MetaCLIP2": dict(_dual_encoders("MetaCLIP2"), projection_dim=16),
    "BLIP2": dict(
        vision_encoder=_sub("BLIP2VisionEncoder", image_size=32, patch_size=8, num_layers=2,
                            num_heads=2, hidden_dim=16, intermediate_dim=32, use_patch_bias=True,
                            use_class_token=True, use_mha_bias=True, use_mlp_bias=True,
                            dropout_rate=0.0, layer_norm_epsilon=1e-6, initializer_range=0.02),
        qformer=_sub("BLIP2QFormer", num_query_tokens=4, num_layers=2, num_heads=2,
                     hidden_dim=16, intermediate_dim=32, vision_dim=16,
                     cross_attention_frequency=1, dropout=0.0, layer_norm_epsilon=1e-6),
        language_model=_sub("BLIP2CustomOPT", vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                            hidden_dim=16, intermediate_dim=32, num_query_tokens=4, dropout=0.0,
                            max_sequence_length=16, qformer_hidden_dim=16),
    ),
}  # fmt: skip
# keras_hub's families outside the zoo, and why
LEFT_OUT = {
    **dict.fromkeys(
        ("BASNet", "DeepLabV3", "SegFormer", "SAM", "SAM3PromptableConcept"),
        "image segmentation (per-pixel targets)",
    ),
    **dict.fromkeys(("DFine", "RetinaNet"), "object detection (boxes)"),
    "DepthAnything": "depth estimation (per-pixel targets)",
    **dict.fromkeys(("Flux", "StableDiffusion3"), "image generation (diffusion)"),
    "VideoPrism": "video",
    "PARSeq": "text recognition: permuted decoding orders drawn in its train step",
    "FeaturePyramid": "a base class, not a family",
}
# (family, layout) -> what hf.fit's refusal says: refused up front, before any step
REFUSED = {
    # keras_hub 0.32's XLNet mixes the samples of its batch (data parallelism ended 2.5 off)
    ("XLNet", "data"): "mixes the samples of a batch",
    ("XLNet", "pipeline"): "mixes the samples of a batch",
}
# Families with BatchNormalization: exact only with statistics of the whole batch (synchronised
# across replicas, one micro-batch per pipeline; docs/models.md)
BATCHNORM = {"ResNet", "DenseNet", "EfficientNet", "MobileNet", "CSPNet", "HGNetV2", "Xception"}
# Adam's epsilon where the default (1e-7) turns float rounding into steps: T5Gemma at T=2 ended
# 2.3e-4 from Keras at its encoder's token table with 1e-7, 3e-7 (every weight) with 1e-3, and
# 1.5e-7 with SGD; the weights whose gradients are near zero take steps of the learning rate
# from rounding alone (a nudge of the initial weights does not show it in the floor)
ADAM_EPSILON = {"T5Gemma": 1e-3}
# Task options besides `num_classes`: VGG's head is two 4,096-wide Dense layers by default
TASK_OPTIONS = {"VGG": {"pooling_hidden_dim": 16}, "MobileNetV5": {"head_hidden_size": 16}}
# Inputs whose unknown length is not a token count: Moonshine's raw audio samples
LENGTHS = {"Moonshine": {"encoder_input_values": 1024, "encoder_padding_mask": 1024}}


def hub_families() -> dict[str, str]:
    """Every family of the installed keras_hub (the prefix of each `...Backbone` class) -> the
    family whose class it is: itself, or the one it is an alias of (Qwen2 is Qwen)."""
    import keras_hub

    names = sorted(n[: -len("Backbone")] for n in dir(keras_hub.models) if n.endswith("Backbone"))
    classes = {name: getattr(keras_hub.models, name + "Backbone") for name in names if name}
    first = {}
    for name, cls in classes.items():  # the name the table uses, else the first
        if name in FAMILIES or cls not in first:
            first[cls] = name
    return {name: first[cls] for name, cls in classes.items()}


def _hub_class(name: str):
    import keras_hub

    return getattr(keras_hub.models, name)


def task_class(family: str):
    """The family's task class (the first `TASK_SUFFIXES` keras_hub has), or None."""
    import keras_hub

    for suffix in TASK_SUFFIXES:
        found = getattr(keras_hub.models, family + suffix, None)
        if found is not None:
            return found
    return None


def backbone(family: str):
    """The family's tiny backbone (None values in a row drop a shared default)."""
    config = {k: v() if callable(v) else v for k, v in FAMILIES[family].items() if v is not None}
    return _hub_class(family + "Backbone")(**config)


def build(family: str) -> keras.Model:
    """The family's task with `preprocessor=None`, or its backbone under a simple head."""
    base = backbone(family)
    task = task_class(family)
    if task is None:
        return _headed(base, family)
    options = {} if _generates(task) else {"num_classes": CLASSES}
    return task(backbone=base, preprocessor=None, **options, **TASK_OPTIONS.get(family, {}))


def _generates(task) -> bool:
    import keras_hub

    generative = (keras_hub.models.CausalLM, keras_hub.models.Seq2SeqLM)
    return issubclass(task, generative) or task.__name__.endswith("AudioToText")


def _headed(base: keras.Model, family: str) -> keras.Model:
    """`base`'s first output (a pooled output if it has one) pooled over its positions, then a
    Dense of `CLASSES` logits. Dual encoders (CLIP) score each image against the batch's texts,
    which no replica's rows can: their two embeddings are concatenated per sample instead."""
    outputs = base.output
    if hasattr(base, "get_vision_embeddings"):
        inputs = base.input
        outputs = keras.layers.Concatenate()(
            [
                base.get_vision_embeddings(inputs["images"]),
                base.get_text_embeddings(inputs["token_ids"]),
            ]
        )
    if isinstance(outputs, dict):
        pooled = [k for k in outputs if "pooled" in k]
        outputs = outputs[pooled[0] if pooled else sorted(outputs)[0]]
    if len(outputs.shape) == 4:
        outputs = keras.layers.GlobalAveragePooling2D()(outputs)
    elif len(outputs.shape) == 3:
        outputs = keras.layers.GlobalAveragePooling1D()(outputs)
    logits = keras.layers.Dense(CLASSES, name="head")(outputs)
    return keras.Model(base.input, logits, name=f"{family.lower()}_headed")


def compiled(family: str, learning_rate: float = 0.01) -> keras.Model:
    """A freshly built model with weights fixed by a seed, compiled with Adam (SGD with
    momentum for `BATCHNORM` families) and a sparse cross-entropy on logits.

    Synchronised BatchNormalization computes its statistics with other kernels than Keras's
    fused one, and a BatchNormalization's beta feeding the next normalisation has a gradient
    of nearly zero: Adam turns its rounding into steps of the learning rate. CSPNet's
    `stage_1_block_0_dark_block_bn_1/beta` ended 2.1e-2 from Keras with Adam, 3.2e-7 with SGD
    (data R=2, synchronised), its model's worst weight then 5.6e-7."""
    model = seeded_build(lambda: build(family))
    optimizer = (
        keras.optimizers.SGD(learning_rate, momentum=0.9)
        if family in BATCHNORM
        else keras.optimizers.Adam(learning_rate, epsilon=ADAM_EPSILON.get(family, 1e-7))
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data(family: str, model: keras.Model, seed: int = 0):
    """Inputs for `model` made from its input specs by name, and integer targets shaped like
    its logits without their last axis: the same on every rank."""
    rng = np.random.default_rng(seed)
    specs = model.input if isinstance(model.input, dict) else {"x": model.input}
    padding = rng.integers(0, 4, size=SAMPLES)  # each sample's last 0 to 3 positions padding
    lengths = LENGTHS.get(family, {})
    x = {
        name: _input(name, spec, rng, padding, lengths.get(name, LENGTH))
        for name, spec in specs.items()
    }
    x = x if isinstance(model.input, dict) else x["x"]
    logits = model.compute_output_spec(_first_rows(x, 2))
    logits = logits[sorted(logits)[0]] if isinstance(logits, dict) else logits
    y = rng.integers(0, logits.shape[-1], size=(SAMPLES, *logits.shape[1:-1])).astype("int32")
    return x, y


def _input(name: str, spec, rng, padding, length: int) -> np.ndarray:
    """One input by its name and spec (`length` for its unknown dimensions): token ids, masks,
    segment ids, position ids, images or features."""
    shape = (SAMPLES, *(length if d is None else d for d in spec.shape[1:]))
    if "mask" in name:
        positions = np.arange(shape[1])[None, :]
        return (positions < shape[1] - padding[:, None]).astype(spec.dtype)
    if "segment" in name:
        return np.zeros(shape, spec.dtype)
    if "position" in name:  # Gemma4's position ids: 0, 1, 2, ... in each sample
        return np.broadcast_to(np.arange(shape[1]), shape).astype(spec.dtype)
    if "int" in str(spec.dtype):
        return rng.integers(1, VOCAB, size=shape).astype(spec.dtype)
    return rng.normal(size=shape).astype(spec.dtype)


def _first_rows(x, n: int):
    if isinstance(x, dict):
        return {k: keras.KerasTensor(v[:n].shape, v.dtype) for k, v in x.items()}
    return keras.KerasTensor(x[:n].shape, x.dtype)
