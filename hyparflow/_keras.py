"""Every use of Keras's private API, in one place: what each reaches into and why.

hyparflow replays Keras's own training step piece by piece, so it needs a few things Keras
does not export: the compiled loss and metrics, the layer walk, a functional model's graph,
the seed generators of random layers. Each entry below names what it uses. All were checked
with Keras 3.15.1 (the main and the compatibility venvs); `tests/test_private_keras.py`
exercises every entry and runs in both `make test` and `make test-compat`, so a Keras release
that moves one fails there first, not deep inside training.
"""

from __future__ import annotations

import contextlib
import sys

import keras

# Classes Keras keeps private. Functional is what keras.Model(inputs, outputs) builds; Node is
# one call of an operation in its graph; the dropout bases are what every Dropout-like layer
# (SpatialDropout*, RNN cells' dropout) derives from.
# Keras's TensorFlow random ops; engine/keras_semantics/random_slices.py replaces its `dropout` for
# the length of a sliced call, so that each piece draws its rows of the global batch's mask.
from keras.src.backend.tensorflow import random as tf_random
from keras.src.layers.regularization.spatial_dropout import BaseSpatialDropout
from keras.src.layers.rnn.dropout_rnn_cell import DropoutRNNCell
from keras.src.models.functional import Functional
from keras.src.models.functional import unpack_singleton as _unpack_singleton
from keras.src.ops.node import Node
from keras.src.optimizers.base_optimizer import BaseOptimizer as _BaseOptimizer
from keras.src.trainers import data_adapters as _data_adapters
from keras.src.trainers.data_adapters.array_slicing import (
    train_validation_split as _train_validation_split,
)
from keras.src.trainers.data_adapters.data_adapter_utils import (
    class_weight_to_sample_weights as _class_weight_to_sample_weights,
)

__all__ = [
    "BaseSpatialDropout",
    "DropoutRNNCell",
    "Functional",
    "Node",
    "tf_random",
]


# --- a compiled model ---------------------------------------------------------------------
def compiled_loss(model):
    """`model._compile_loss`: the loss `compile()` built (None when compiled without one)."""
    return getattr(model, "_compile_loss", None)


def compiled_metrics(model):
    """`model._compile_metrics`: the metrics `compile()` built, or None."""
    return getattr(model, "_compile_metrics", None)


def compiled_metric_objects(model) -> list:
    """The metric objects given to `compile()` (`CompileMetrics._user_metrics` and
    `_user_weighted_metrics`), built or not: their variables exist from compile on, while
    `model.metrics` lists them only once the compiled metrics are built at the first step."""
    compiled = compiled_metrics(model)
    if compiled is None:
        return []
    specs = (compiled._user_metrics, compiled._user_weighted_metrics)
    return [
        m
        for spec in specs
        if spec is not None
        for m in keras.tree.flatten(spec)
        if isinstance(m, keras.metrics.Metric)
    ]


def loss_tracker(model):
    """`model._loss_tracker`: the Mean that `fit` reports as "loss"."""
    return model._loss_tracker


def output_loss_means(compile_loss) -> list:
    """`CompileLoss.metrics`: the Mean per output ("<output>_loss") that its `build()` makes
    when there are several losses; each call updates them with the output's batch loss,
    weighted by the batch's static size (engine/keras_semantics/output_losses.py)."""
    return list(compile_loss.metrics)


def outputs_structure_of(model):
    """`Functional._outputs_struct` of `model`, or of the Functional a Sequential wraps
    (`Sequential._functional`): the nesting `model(x)` returns; None for a subclassed model."""
    struct = getattr(model, "_outputs_struct", None)
    if struct is None:
        struct = getattr(getattr(model, "_functional", None), "_outputs_struct", None)
    return struct


def metrics_in_order(model, logs: dict) -> list:
    """`model._flatten_metrics_in_order`: `evaluate`'s list result from its logs dict."""
    return model._flatten_metrics_in_order(logs)


# --- layers --------------------------------------------------------------------------------
def all_layers(model, include_self: bool = True, recursive: bool = True) -> list:
    """`Layer._flatten_layers`: every layer tracked under `model`, nested ones included."""
    return list(model._flatten_layers(include_self=include_self, recursive=recursive))


def own_losses(layer) -> list:
    """`Layer._get_own_losses`: the add_loss values of this layer alone, not of sublayers."""
    return layer._get_own_losses()


def seed_generators(layer) -> list:
    """`Layer._seed_generators`: the SeedGenerators a layer tracks."""
    return list(getattr(layer, "_seed_generators", []))


def reduction_axes(layer) -> list:
    """`BatchNormalization._reduction_axes`: the axes its moments are taken over."""
    return layer._reduction_axes


# `BatchNormalization._moments(inputs, mask)`: a layer's batch moments, which
# engine/keras_semantics/sync_batchnorm.py replaces per instance (through `intercept.py`) to
# take them over the replicas.
BATCHNORM_MOMENTS = "_moments"


def call_context_args(operation) -> tuple:
    """`Layer._call_context_args`: the call arguments (such as "training") that a Functional
    hands down from its own call context."""
    return tuple(getattr(operation, "_call_context_args", ()))


def called_by_spatial_dropout() -> bool:
    """Whether the nearest Keras layer up the Python stack is a SpatialDropout layer: Keras's
    dropout is not told who calls it, and SpatialDropout alone passes a 1 read from a one-row
    input's shape as its noise shape's batch dim (engine/keras_semantics/random_slices.py)."""
    return isinstance(calling_layer(), BaseSpatialDropout)


def calling_layer():
    """The innermost Keras layer running up the Python stack (the nearest frame whose `self` is
    a Layer), or None: Keras's random functions, and `hf.global_mean`, are not told who calls
    them. Read at trace time, not per step."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.layers.Layer):
            return owner
        frame = frame.f_back
    return None


# --- a functional graph ---------------------------------------------------------------------
def inner_functional(model):
    """`Sequential._functional`: the Functional a built Sequential runs (None unbuilt)."""
    return model._functional


def nodes_by_depth(functional) -> dict:
    """`Functional._nodes_by_depth`: depth -> the graph's nodes (inputs deepest)."""
    return functional._nodes_by_depth


def inputs_structure(functional):
    """`Functional._inputs_struct`: the nesting of the model's inputs (dict, list, tensor)."""
    return functional._inputs_struct


def outputs_structure(functional):
    """`Functional._outputs_struct`: the nesting of the model's outputs."""
    return functional._outputs_struct


def standardize_inputs(functional, inputs) -> list:
    """`Functional._standardize_inputs`: user inputs flattened in `functional.inputs` order."""
    return list(functional._standardize_inputs(inputs))


def is_keras_tensor(value) -> bool:
    """Whether `value` carries `_keras_history`: a symbolic tensor some operation produced."""
    return hasattr(value, "_keras_history")


def producer_name(keras_tensor) -> str:
    """`KerasTensor._keras_history`: the name of the operation that made this tensor."""
    return keras_tensor._keras_history.operation.name


def keras_mask(keras_tensor):
    """`KerasTensor._keras_mask`: the mask a symbolic tensor carries, or None."""
    return getattr(keras_tensor, "_keras_mask", None)


def unpack_singleton(value):
    """`keras.src.models.functional.unpack_singleton`: a one-element list as its element."""
    return _unpack_singleton(value)


# --- data adapters --------------------------------------------------------------------------
def train_validation_split(arrays, validation_split: float):
    """Keras's `validation_split`: the last fraction of the arrays becomes validation data."""
    return _train_validation_split(arrays, validation_split=validation_split)


def class_weight_to_sample_weights(y, class_weight: dict):
    """Keras's `class_weight`: a per-sample weight from each sample's class."""
    return _class_weight_to_sample_weights(y, class_weight)


def data_adapter(
    x, y=None, sample_weight=None, *, batch_size=None, steps=None, shuffle=False, class_weight=None
):
    """`keras.src.trainers.data_adapters.get_data_adapter`: what `model.fit` reads `x` with
    (arrays, tf.data.Dataset, PyDataset, generators), refusing what Keras refuses with its
    message. Its `get_numpy_iterator()` is one pass over the data; `num_batches` is None when
    unknown."""
    return _data_adapters.get_data_adapter(
        x,
        y,
        sample_weight,
        batch_size=batch_size,
        steps_per_epoch=steps,
        shuffle=shuffle,
        class_weight=class_weight,
    )


def is_array_adapter_input(x, y=None, sample_weight=None) -> bool:
    """Whether Keras reads (x, y, sample_weight) as arrays (`ArrayDataAdapter`)."""
    return _data_adapters.array_data_adapter.can_convert_arrays((x, y, sample_weight))


def is_array_adapter(adapter) -> bool:
    return isinstance(adapter, _data_adapters.ArrayDataAdapter)


def adapter_arrays(adapter) -> tuple:
    """`ArrayDataAdapter._inputs`: (x,), (x, y) or (x, y, sample_weight) after Keras turned class
    weights into sample weights and broadcast one sample-weight array over the outputs; the
    arrays as given (not copied)."""
    return adapter._inputs


# --- variables a layer tracks ---------------------------------------------------------------
def own_trainable_variables(layer) -> list:
    """`Layer._trainable_variables`: the list of the layer's own trainable variables (not its
    sublayers'), which `trainable_variables` walks; tensor parallelism puts shards in it."""
    return layer._trainable_variables


def stored_value(variable):
    """`Variable._value`: the backend variable behind a Keras variable, whatever a
    StatelessScope maps it to."""
    return variable._value


def variable_autocast(variable) -> bool:
    """`Variable._autocast`: whether the variable casts to a layer's compute dtype."""
    return getattr(variable, "_autocast", True)


def set_keras_mask(tensor, mask) -> None:
    """`backend.set_keras_mask`: attach a Keras mask to a tensor, as layers' calls do."""
    from keras.src.backend import set_keras_mask as _set

    _set(tensor, mask)


def applies_as_base_optimizer(optimizer) -> bool:
    """Whether `type(optimizer)` keeps Keras's `BaseOptimizer.apply` and its per-variable step
    `BaseOptimizer._backend_apply_gradients` (neither overridden, e.g. to accumulate)."""
    kind = type(optimizer)
    return (
        kind.apply is _BaseOptimizer.apply
        and kind._backend_apply_gradients is _BaseOptimizer._backend_apply_gradients
    )


def key_variables_by_identity(optimizer) -> None:
    """`Optimizer._var_key` replaced on this optimizer by `id`: it keys its slots by each
    variable's identity, not by its tf.Variable (checkpoint/optimizer_file.py), until
    `restore_variable_keys`."""
    object.__setattr__(optimizer, "_var_key", id)


def restore_variable_keys(optimizer) -> None:
    """The optimizer's own `Optimizer._var_key` again (the class's method)."""
    object.__delattr__(optimizer, "_var_key")


def update_progbar(logger, batch, logs) -> None:
    """`ProgbarLogger._update_progbar`: show a batch's logs on Keras's progress bar."""
    logger._update_progbar(batch, logs)


def finalize_progbar(logger, logs) -> None:
    """`ProgbarLogger._finalize_progbar`: show an epoch's final logs on the progress bar."""
    logger._finalize_progbar(logs)


def excludes_from_weight_decay(optimizer) -> bool:
    """`Optimizer._exclude_from_weight_decay(_pattern)`: whether `exclude_from_weight_decay`
    named some variables, so that weight decay is not the same rule for every element."""
    return bool(getattr(optimizer, "_exclude_from_weight_decay", None)) or (
        getattr(optimizer, "_exclude_from_weight_decay_pattern", None) is not None
    )


# --- the variables and sublayers tensor parallelism splits -----------------------------------
def kernel_variable(layer):
    """`layer._kernel`: a Dense, EinsumDense or Conv layer's kernel variable itself (its
    `kernel` property may add LoRA or dequantize)."""
    return layer._kernel


def table_variable(layer):
    """`layer._embeddings`: an Embedding's table variable itself."""
    return layer._embeddings


def has_table_variable(layer) -> bool:
    """Whether `layer` holds an Embedding's table variable `_embeddings` (built, or a subclass
    such as keras_hub's ReversibleEmbedding that keeps it)."""
    return hasattr(layer, "_embeddings")


def attention_parts(layer) -> dict:
    """A `keras.layers.MultiHeadAttention`'s projections, score dropout and settings:
    `_query_dense`, `_key_dense`, `_value_dense`, `_gate_dense`, `_output_dense`,
    `_dropout_layer`, `_dropout`, `_attention_axes`."""
    return {
        "query": layer._query_dense,
        "key": layer._key_dense,
        "value": layer._value_dense,
        "gate": layer._gate_dense if getattr(layer, "_use_gate", False) else None,
        "output": layer._output_dense,
        "dropout": layer._dropout_layer,
        "rate": layer._dropout,
        "axes": tuple(layer._attention_axes or ()),
    }


# --- deferred variables (hyparflow/deferred.py) -------------------------------------------
# A variable made inside a StatelessScope keeps its initializer in `_initializer` and no value
# (`_value` None) until `_deferred_initialize()`; Keras lists such variables in the global
# attribute "uninitialized_variables", which a top-level StatelessScope's exit initialises.
def uninitialized_variables() -> list:
    """Keras's global list of variables waiting for their deferred initialisation (live)."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("uninitialized_variables", [], set_to_default=True)


def is_uninitialized(variable) -> bool:
    """Whether `variable` has no value yet (made in a StatelessScope, never initialised)."""
    return getattr(variable, "_value", 0) is None


def deferred_initializer(variable):
    """The initializer an uninitialised variable will be given its value by."""
    return variable._initializer


def set_deferred_initializer(variable, initializer) -> None:
    variable._initializer = initializer


def initialize_deferred(variable) -> None:
    """Give an uninitialised variable its value from its initializer (Keras's own step)."""
    variable._deferred_initialize()


def backing(variable):
    """The backend variable (a tf.Variable) behind Keras `variable`, None while uninitialised."""
    return variable._value


def set_backing(variable, backend_variable) -> None:
    """Put `backend_variable` behind Keras `variable` in place of its own (deferred.take_over:
    a backing that can be emptied and filled again)."""
    variable._value = backend_variable
    variable._initializer = None


# Keras's compiled steps, kept on the model and traced again when None
COMPILED_STEPS = ("train_function", "test_function", "predict_function")


def forget_compiled_steps(model) -> None:
    """Make Keras trace its fit, evaluate and predict steps again at their next use."""
    for name in COMPILED_STEPS:
        setattr(model, name, None)


def stateless_updates(scope) -> dict:
    """id(variable) -> value of the assignments a StatelessScope collected instead of doing."""
    return scope.state_mapping


@contextlib.contextmanager
def outside_stateless_scope():
    """Keras's global attribute "stateless_scope" cleared for a moment, then restored: a
    variable made meanwhile is created with its value (Keras refuses one from a value inside)."""
    from keras.src.backend.common import global_state

    scope = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


def current_stateless_scope():
    """Keras's open `StatelessScope`, or None."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


# Keras's global attributes that shape a layer's call besides the stateless scope: the call
# context (the `training` a model hands down) and the autocast scope (mixed precision). A
# ZeRO-3 layer boundary recomputes its call in the backward, outside the forward's `__call__`
# (engine/stages/layer_gathering.py), and replays them.
_CALL_STATE = ("current_call_ctx", "autocast_scope")


def call_state() -> dict:
    """The Keras call state now (`_CALL_STATE`'s global attributes)."""
    from keras.src.backend.common import global_state

    return {name: global_state.get_global_attribute(name) for name in _CALL_STATE}


@contextlib.contextmanager
def calling_under(state: dict):
    """Keras's call state set to `state` (from `call_state`) for a while, then put back."""
    from keras.src.backend.common import global_state

    before = call_state()
    for name, value in state.items():
        global_state.set_global_attribute(name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            global_state.set_global_attribute(name, value)


def own_loss(layer, loss) -> None:
    """`Layer._loss_ids`: count `loss`, added to the open stateless scope, as `layer`'s own
    (a ZeRO-3 layer boundary hands out the losses its call added as new tensors)."""
    layer._loss_ids.add(id(loss))


# --- the .keras file (hyparflow/checkpoint/export.py) --------------------------------------
# Keras writes a `.keras` zip's weights into memory first unless psutil says the host lacks
# memory (it does not see cgroup limits); the export writes the same three members itself,
# streaming the weights from a `.weights.h5` file.
def keras_file_members(model) -> dict:
    """{member name: text} of a `.keras` zip's metadata and config, and the name of its weights
    member, as `model.save` writes them (Keras's own serialisation, shared objects kept)."""
    from keras.src.saving import saving_lib

    config_json, metadata_json = saving_lib._serialize_model_as_json(model)
    return {
        "texts": {
            saving_lib._METADATA_FILENAME: metadata_json,
            saving_lib._CONFIG_FILENAME: config_json,
        },
        "weights": saving_lib._VARS_FNAME_H5,
    }
