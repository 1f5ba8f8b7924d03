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
