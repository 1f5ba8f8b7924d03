"""A model named on the command line: a saved `.keras` file, or `module:function` that builds it.

A saved model with custom layers loads once their module is imported (`--custom-objects
module.path`): its classes registered with `keras.saving.register_keras_serializable` are found
by their registered names, and its other public classes and functions by their own names, as
`keras.saving.load_model(custom_objects=...)` takes them. Modules are looked up from the current
folder first, as `python -m` does.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
import zipfile

CUSTOM_OBJECTS_HELP = (
    "import this module (e.g. mypkg.layers) before loading the model: its custom layers, "
    "losses and functions are found by name"
)


def load_model(source: str, custom_objects: str | None = None, compile: bool = True):
    """The Keras model at `source`: a `.keras` file, or `module:function` called with no argument.

    Example:
        $ hyparflow plan mypkg.models:build_model --partitions 2
        $ hyparflow plan model.keras --custom-objects mypkg.layers --partitions 2
    """
    import keras

    objects = _public_objects(custom_objects) if custom_objects else None
    if _is_builder(source):
        module, _, function = source.partition(":")
        build = getattr(_import(module), function, None)
        if not callable(build):
            raise ValueError(f"{source!r}: module {module!r} has no function {function!r}")
        model = build()
        if not isinstance(model, keras.Model):
            raise ValueError(f"{source!r} returned {type(model).__name__}, not a keras.Model")
        return model
    if not os.path.exists(source):
        raise ValueError(f"{source!r} is neither a saved model file nor module:function")
    try:
        with warnings.catch_warnings():
            # the slots' values are not read here (only their sizes, from the optimizer's
            # config), and Keras would say it skipped them before every plan
            warnings.filterwarnings("ignore", "Skipping variable loading for optimizer")
            return keras.saving.load_model(source, custom_objects=objects, compile=compile)
    except TypeError as error:  # Keras's "Could not locate class ..." for a custom object
        hint = "" if custom_objects else " (custom objects? pass --custom-objects MODULE)"
        raise ValueError(f"cannot load {source!r}{hint}: {error}") from error


def load_architecture(source: str, custom_objects: str | None = None):
    """The model at `source` without its weights, for planning: a `.keras` file's architecture
    and compile arguments rebuilt under `hf.scope()` (nothing allocated, the weights file never
    read), or `module:function` called as it is (built under hf.scope() or not, as it does)."""
    if _is_builder(source) or not zipfile.is_zipfile(source):
        return load_model(source, custom_objects)
    import keras

    from hyparflow.deferred import scope

    objects = _public_objects(custom_objects) if custom_objects else None
    with zipfile.ZipFile(source) as archive:
        config = json.loads(archive.read("config.json"))
    compiled = config.pop("compile_config", None)
    try:
        with scope():
            model = keras.saving.deserialize_keras_object(config, custom_objects=objects)
            if compiled:  # compile() itself: compile_from_config would build the optimizer
                model.compile(**keras.saving.deserialize_keras_object(compiled, objects))
    except TypeError as error:  # Keras's "Could not locate class ..." for a custom object
        hint = "" if custom_objects else " (custom objects? pass --custom-objects MODULE)"
        raise ValueError(f"cannot load {source!r}{hint}: {error}") from error
    return model


def _is_builder(source: str) -> bool:
    """`module:function`, not a file (a Windows drive letter or an existing path is a file)."""
    module, colon, function = source.partition(":")
    return (
        bool(colon)
        and not os.path.exists(source)
        and module.replace(".", "").isidentifier()
        and function.isidentifier()
    )


def _import(module: str):
    """Import `module`, looking in the current folder first as `python -m` does."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ValueError(f"cannot import {module!r}: {error}") from error


def _public_objects(module: str) -> dict:
    """The public classes and functions of `module`, by name (imported, so registered too)."""
    namespace = vars(_import(module))
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("_") and callable(value)
    }
