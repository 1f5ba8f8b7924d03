"""A rank's share of the training state, keyed so that another partitioning can load it.

Keys name positions in the user's model, never Keras's auto-generated names (a new process may
number layers differently): `w/<i>` is `model.weights[i]`, `opt/<i>/<slot>` an optimizer slot
of `model.trainable_variables[i]`, `opt/<name>` a global optimizer variable (iteration, learning
rate), `seed/<layer>/<j>` a layer's random seed state, `m/<i>` a summed metric state.
"""

from __future__ import annotations

import numpy as np

from hyparflow import _keras


def weight_specs(model) -> list:
    """[path, shape, dtype] of every model weight: the checkpoint's fingerprint of the model."""
    return [[v.path, list(v.shape), str(v.dtype)] for v in model.weights]


def _slot_prefixes(model) -> list[tuple[str, int]]:
    prefixes = [
        (v.path.replace("/", "_") + "_", i) for i, v in enumerate(model.trainable_variables)
    ]
    return sorted(prefixes, key=lambda p: -len(p[0]))  # longest first: "d_1_k_" before "d_1_"


def optimizer_state(model, optimizer) -> dict:
    """The optimizer's variables, keyed by model variable index and slot name."""
    prefixes = _slot_prefixes(model)
    state = {}
    for variable in optimizer.variables:
        name = variable.name
        for prefix, index in prefixes:
            if name.startswith(prefix):
                state[f"opt/{index}/{name[len(prefix) :]}"] = np.asarray(variable.numpy())
                break
        else:
            state[f"opt/{name}"] = np.asarray(variable.numpy())
    return state


def restore_optimizer(model, optimizer, variables, state: dict) -> None:
    """Build `optimizer` for `variables` (a stage's) and load their slots from `state`."""
    if variables and not optimizer.built:
        optimizer.build(variables)
    prefixes = _slot_prefixes(model)
    missing = []
    for variable in optimizer.variables:
        name = variable.name
        key = f"opt/{name}"
        for prefix, index in prefixes:
            if name.startswith(prefix):
                key = f"opt/{index}/{name[len(prefix) :]}"
                break
        if key in state:
            variable.assign(state[key])
        else:
            missing.append(name)
    if missing:
        raise ValueError(
            f"The checkpoint has no optimizer state for {missing[:3]}; it was written with a "
            f"different optimizer. Compile with the optimizer it was trained with, or start "
            "without resume."
        )


def seed_generators(model) -> list[tuple[str, object]]:
    """(key, state variable) of every layer's random seed generator (Dropout and friends)."""
    found = []
    for index, layer in enumerate(_keras.all_layers(model, include_self=False)):
        for j, generator in enumerate(_keras.seed_generators(layer)):
            found.append((f"seed/{index}/{j}", generator.state))
    return found


def layers_of_seed_keys(model) -> dict:
    """Seed key -> layer object, so the stage that calls a layer saves its generator."""
    owners = {}
    for index, layer in enumerate(_keras.all_layers(model, include_self=False)):
        for j, _ in enumerate(_keras.seed_generators(layer)):
            owners[f"seed/{index}/{j}"] = layer
    return owners
