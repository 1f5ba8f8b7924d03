"""Turn a distributed checkpoint into one ordinary Keras `.keras` file."""

from __future__ import annotations

import json
import os

import keras

from hyparflow.checkpoint import store


def export(checkpoint_dir: str, path: str, model=None) -> str:
    """Write the latest checkpoint in `checkpoint_dir` as a single Keras model file at `path`.

    The architecture comes from the checkpoint (models with a config) or from `model` (any
    model, e.g. subclassed: pass a freshly built one). The model is compiled as it was for
    training (so `evaluate` works on the loaded file); optimizer state is not included.

    Example:
        >>> hf.export("checkpoints/", "trained.keras")
        >>> model = keras.saving.load_model("trained.keras")
    """
    folder = store.find(checkpoint_dir, required=True)
    if model is None:
        manifest = store.manifests.read(folder)
        if manifest.architecture is None:
            raise ValueError(
                "This checkpoint has no architecture (the model has no config, e.g. it is "
                "subclassed); pass model=<a freshly built model> to hf.export."
            )
        with open(os.path.join(folder, manifest.architecture)) as f:
            model = keras.models.model_from_json(f.read())
    manifest, state = store.read_checked(folder, model)
    for i, variable in enumerate(model.weights):
        variable.assign(state[f"w/{i}"])
    if manifest.compile_config and not getattr(model, "compiled", False):
        with open(os.path.join(folder, manifest.compile_config)) as f:
            model.compile_from_config(json.load(f))
    model.save(path)
    return path
