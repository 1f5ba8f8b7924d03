"""Turn a distributed checkpoint into one ordinary Keras `.keras` file, variable by variable."""

from __future__ import annotations

import json
import os
import tempfile
import zipfile

import keras

from hyparflow import _keras, deferred
from hyparflow.checkpoint import store
from hyparflow.checkpoint.optimizer_file import stream_optimizer


def export(checkpoint_dir: str, path: str, model=None) -> str:
    """Write the latest checkpoint in `checkpoint_dir` as a single Keras model file at `path`.

    The architecture comes from the checkpoint (models with a config) or from `model` (any
    model, e.g. subclassed: pass a freshly built one, under `hf.scope()` if it is big). The
    model is compiled as it was for training, with the checkpoint's whole optimizer state
    (every slot, the step counter), so `load_model` and `fit` go on as the training would
    have. The architecture and the optimizer are built without allocating their variables
    (`hf.scope()`), and each variable is read from the checkpoint's files as the file is
    written, so the exporting process holds one at a time, never the whole model.

    For example:
        hf.export("checkpoints/", "trained.keras")
        model = keras.saving.load_model("trained.keras")
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
            architecture = json.load(f)
        # compiled below from the manifest's own compile config, as Keras compiles from config
        architecture.pop("compile_config", None)
        with deferred.scope():
            model = keras.models.model_from_json(json.dumps(architecture))
    manifest, state = store.read_checked(folder, model)
    position = {id(v): i for i, v in enumerate(model.weights)}
    for i, variable in enumerate(model.weights):
        if not deferred.is_deferred(variable):
            variable.assign(state[f"w/{i}"])
    if manifest.compile_config and not getattr(model, "compiled", False):
        with open(os.path.join(folder, manifest.compile_config)) as f:
            # as Keras's compile_from_config, without building the optimizer's state
            model.compile(**keras.saving.deserialize_keras_object(json.load(f)))
    slots = {}
    if getattr(model, "optimizer", None) is not None:
        slots = stream_optimizer(model, state)  # id(slot) -> its checkpoint key

    def value(variable):  # a weight or slot from the checkpoint; seed states as built
        if id(variable) in position:
            return state[f"w/{position[id(variable)]}"]
        if id(variable) in slots:
            return state[slots[id(variable)]]
        return deferred.initial_value(variable)

    try:
        with deferred.reading(value):
            _write_keras_file(model, path)
    finally:
        state.close()
    return path


def _write_keras_file(model, path: str) -> None:
    """`model.save(path)`, but the weights stream through a file beside `path`: Keras would
    hold them all in memory unless psutil says the host is short of it (cgroup limits unseen)."""
    members = _keras.keras_file_members(model)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(path))) as scratch:
        weights = os.path.join(scratch, "export.weights.h5")
        model.save_weights(weights)  # one weight read (from the checkpoint) and written at a time
        with zipfile.ZipFile(path, "w") as archive:  # stored, not compressed, as Keras does
            for name, text in members["texts"].items():
                archive.writestr(name, text)
            archive.write(weights, members["weights"])
