"""The user's inputs and outputs in the structures the model's graph and Keras expect."""

from __future__ import annotations

from keras import tree

from hyparflow import _keras


def model_input_list(model, x) -> list:
    """The user's `x` (array, list or dict) as a list in `model.inputs` order."""
    if isinstance(x, dict):
        names = [_keras.producer_name(t) for t in model.inputs]
        if set(names) <= set(x):
            return [x[name] for name in names]
        return tree.flatten(x)
    return list(x) if isinstance(x, (list, tuple)) else [x]


def pack_model_outputs(model, flat: list):
    """The last stage's flat outputs in the structure `model(x)` returns (tensor, list, dict)."""
    struct = _keras.outputs_structure_of(model)  # None for a subclassed model
    if struct is None:
        return flat[0] if len(flat) == 1 else list(flat)
    return tree.pack_sequence_as(struct, flat)


def stage_call(model, plan, stage):
    """`call(inputs, training)` of the partitioner's `stage` of `plan` (None: the whole model):
    the model's outputs as Keras packs them at the model's last stage, a flat list elsewhere."""
    if stage is None:
        return lambda x, training: model(x, training=training)
    last = stage.index == len(plan.stages) - 1

    def call(inputs, training):
        outputs = stage.forward(inputs, training=training)
        flat = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        return pack_model_outputs(model, flat) if last else flat

    return call
