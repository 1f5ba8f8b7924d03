"""Every entry of hyparflow._keras still reaches what it names in the installed Keras.

Runs in `make test` and in the compatibility job (TensorFlow 2.17), so a Keras release that
moves a private attribute fails here, by name, before it fails inside training. And no other
module of hyparflow reaches Keras's private API: no `keras.src`, no private attribute by name,
no walk up the caller's stack (a planted one is found).
"""

import ast
import os
import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from hyparflow import _keras
from hyparflow.intercept import Replaced, instead


def _model():
    inputs = {"a": keras.Input((4,), name="a"), "b": keras.Input((2,), name="b")}
    x = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    x = keras.layers.Dense(3, activity_regularizer="l2", name="dense")(x)
    x = keras.layers.BatchNormalization(name="norm")(x)
    x = keras.layers.Dropout(0.5, seed=1, name="drop")(x)
    model = keras.Model(inputs, [x, keras.layers.Dense(1, name="head")(x)])
    model.compile(optimizer="sgd", loss=["mse", "mse"], metrics=[["mae"], []])
    return model


def test_compiled_model_entries():
    model = _model()
    data = {"a": np.ones((4, 4), "float32"), "b": np.ones((4, 2), "float32")}
    model.evaluate(data, [np.ones((4, 3)), np.ones((4, 1))], verbose=0)
    assert callable(_keras.compiled_loss(model))
    assert _keras.compiled_metrics(model) is not None
    compiled = keras.Model(model.inputs, model.outputs)
    accuracy = keras.metrics.BinaryAccuracy()
    compiled.compile(loss=["mse", "mse"], metrics=[[accuracy], []], weighted_metrics=[["mse"], []])
    assert _keras.compiled_metric_objects(compiled) == [accuracy]  # strings are built later
    assert isinstance(_keras.loss_tracker(model), keras.metrics.Mean)
    means = _keras.output_loss_means(_keras.compiled_loss(model))
    assert len(means) == 2 and all(isinstance(m, keras.metrics.Mean) for m in means)
    logs = model.evaluate(data, [np.ones((4, 3)), np.ones((4, 1))], verbose=0, return_dict=True)
    assert _keras.metrics_in_order(model, logs)[0] == logs["loss"]
    assert model.test_function is not None
    _keras.forget_compiled_steps(model)  # Keras traces its step again at the next evaluate
    assert all(getattr(model, name) is None for name in _keras.COMPILED_STEPS)


def test_layer_entries():
    model = _model()
    names = [layer.name for layer in _keras.all_layers(model, include_self=False)]
    assert {"dense", "norm", "drop", "head"} <= set(names)
    dense, norm, drop = (model.get_layer(n) for n in ("dense", "norm", "drop"))
    dense(np.ones((2, 6), "float32"))
    assert len(_keras.own_losses(dense)) == 1  # the activity regularizer's value
    assert _keras.seed_generators(drop) and _keras.seed_generators(dense) == []
    assert list(_keras.reduction_axes(norm)) == [0]
    assert issubclass(keras.layers.SpatialDropout1D, _keras.BaseSpatialDropout)
    assert hasattr(_keras.tf_random, "dropout")


def test_functional_graph_entries():
    model = _model()
    assert isinstance(model, _keras.Functional)
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert isinstance(_keras.inner_functional(sequential), _keras.Functional)
    assert sum(len(nodes) for nodes in _keras.nodes_by_depth(model).values()) >= 6
    assert set(_keras.inputs_structure(model)) == {"a", "b"}
    assert len(_keras.outputs_structure(model)) == 2
    flat = _keras.standardize_inputs(model, {"b": np.zeros((1, 2)), "a": np.ones((1, 4))})
    assert [tuple(t.shape) for t in flat] == [(1, 4), (1, 2)]
    assert _keras.producer_name(model.outputs[1]) == "head"
    assert _keras.unpack_singleton([7]) == 7
    masked = keras.layers.Embedding(5, 2, mask_zero=True)(keras.Input((3,), dtype="int32"))
    assert _keras.keras_mask(masked) is not None and _keras.keras_mask(model.outputs[0]) is None
    node = _keras.nodes_by_depth(model)[0][0]
    assert isinstance(node, _keras.Node)
    cell = keras.layers.LSTMCell(2, dropout=0.1)
    assert isinstance(cell, _keras.DropoutRNNCell)


def test_data_adapter_entries():
    x, y = np.arange(10.0), np.arange(10.0) % 2
    (tx, ty), (vx, vy) = _keras.train_validation_split((x, y), 0.2)
    assert len(tx) == 8 and list(vx) == [8.0, 9.0]
    weights = _keras.class_weight_to_sample_weights(y.astype("int64"), {0: 1.0, 1: 3.0})
    assert list(np.asarray(weights)[:2]) == [1.0, 3.0]
    x2 = x.reshape(5, 2)
    adapter = _keras.data_adapter(x2, y[:5], batch_size=2, class_weight={0: 1.0, 1: 3.0})
    assert _keras.is_array_adapter_input(x2, y[:5]) and _keras.is_array_adapter(adapter)
    given, targets, sample_weight = _keras.adapter_arrays(adapter)
    assert given is x2 and list(np.asarray(sample_weight)) == [1.0, 3.0, 1.0, 3.0, 1.0]
    assert adapter.batch_size == 2 and adapter.num_batches == 3
    dataset = tf.data.Dataset.from_tensor_slices((x2, y[:5])).batch(2)
    assert not _keras.is_array_adapter(_keras.data_adapter(dataset))
    with pytest.raises(ValueError, match="`y` should not be passed"):
        _keras.data_adapter(dataset, y[:5])


def test_tensor_parallel_entries():
    dense = keras.layers.Dense(4, name="d")
    dense.build((None, 3))
    assert _keras.kernel_variable(dense) is dense.kernel
    assert dense.kernel in _keras.own_trainable_variables(dense)
    assert _keras.variable_autocast(dense.kernel) is True
    table = keras.layers.Embedding(10, 3)
    table.build((None,))
    assert _keras.table_variable(table) is table.embeddings
    attention = keras.layers.MultiHeadAttention(2, 4, dropout=0.1)
    attention(np.ones((1, 3, 8), "float32"), np.ones((1, 3, 8), "float32"))
    parts = _keras.attention_parts(attention)
    assert {parts[k].name for k in ("query", "key", "value", "output")} == {
        "query",
        "key",
        "value",
        "attention_output",
    }
    assert parts["gate"] is None and parts["rate"] == 0.1 and parts["axes"] == (1,)
    assert isinstance(parts["dropout"], keras.layers.Dropout)
    tensor = keras.ops.ones((2, 3))
    _keras.set_keras_mask(tensor, keras.ops.ones((2,), "bool"))
    assert tensor._keras_mask is not None


def test_deferred_variable_entries():
    waiting = _keras.uninitialized_variables()
    before = len(waiting)
    with keras.StatelessScope(initialize_variables=False) as scope:
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        layer.bias.assign(np.ones(2, "float32"))  # collected by the scope, not done
    kernel = layer.kernel
    assert _keras.uninitialized_variables() is waiting and len(waiting) == before + 2
    assert id(layer.bias) in _keras.stateless_updates(scope)
    assert _keras.is_uninitialized(kernel)
    initializer = _keras.deferred_initializer(kernel)
    assert callable(initializer)
    _keras.set_deferred_initializer(kernel, keras.initializers.Ones())
    _keras.initialize_deferred(kernel)
    assert not _keras.is_uninitialized(kernel) and float(kernel.numpy().sum()) == 6.0
    backing = tf.Variable(np.zeros((3, 2), "float32"))
    _keras.set_backing(kernel, backing)  # ZeRO-3 puts an emptiable variable behind it
    assert _keras.backing(kernel) is backing and float(kernel.numpy().sum()) == 0.0
    del waiting[before:]
    with keras.StatelessScope(initialize_variables=False) as scope:
        with _keras.outside_stateless_scope():  # Keras refuses a value in a stateless scope
            counter = keras.Variable(3, trainable=False)
        assert keras.src.backend.common.stateless_scope.get_stateless_scope() is scope
    assert int(counter.numpy()) == 3


def test_keras_file_entries(tmp_path):
    model = _model()
    members = _keras.keras_file_members(model)
    assert set(members["texts"]) == {"metadata.json", "config.json"}
    assert members["weights"] == "model.weights.h5"
    model.save(tmp_path / "m.keras")
    import zipfile

    assert set(zipfile.ZipFile(tmp_path / "m.keras").namelist()) >= {
        *members["texts"],
        members["weights"],
    }


def test_optimizer_entries():
    optimizer = keras.optimizers.AdamW()
    assert _keras.excludes_from_weight_decay(optimizer) is False
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    assert _keras.excludes_from_weight_decay(optimizer) is True


def test_entries_the_engine_reaches(capsys):
    model = _model()
    assert len(_keras.outputs_structure_of(model)) == 2
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert _keras.is_keras_tensor(_keras.outputs_structure_of(sequential))
    assert _keras.outputs_structure_of(keras.layers.Dense(2)) is None
    assert _keras.is_keras_tensor(keras.Input((2,))) and not _keras.is_keras_tensor(np.ones(2))
    assert "training" in _keras.call_context_args(model.get_layer("drop"))
    table = keras.layers.Embedding(10, 3)
    table.build((None,))
    assert _keras.has_table_variable(table)
    assert not _keras.has_table_variable(model.get_layer("head"))
    logger = keras.callbacks.ProgbarLogger()
    logger.set_params({"epochs": 1, "steps": 2, "verbose": 1})
    logger.on_epoch_begin(0)
    _keras.update_progbar(logger, 0, {"loss": 0.5})
    _keras.finalize_progbar(logger, {"loss": 0.25})
    assert "loss: 0.2500" in capsys.readouterr().out


def test_optimizer_overrides_and_keys():
    class Accumulating(keras.optimizers.SGD):
        def _backend_apply_gradients(self, grads, trainable_variables):
            return super()._backend_apply_gradients(grads, trainable_variables)

    assert _keras.applies_as_base_optimizer(keras.optimizers.Adam())
    assert not _keras.applies_as_base_optimizer(Accumulating())
    optimizer, variable = keras.optimizers.SGD(), keras.Variable(np.zeros(2, "float32"))
    own_key = optimizer._var_key(variable)
    _keras.key_variables_by_identity(optimizer)
    assert optimizer._var_key(variable) == id(variable) != own_key
    _keras.restore_variable_keys(optimizer)
    assert optimizer._var_key(variable) == own_key


def test_batchnorm_moments_replaced_for_one_layer():
    norm, other = (keras.layers.BatchNormalization(epsilon=0.0) for _ in range(2))
    x = np.array([[1.0, 2.0], [3.0, 6.0]], "float32")
    for layer in (norm, other):
        layer.build(x.shape)
    assert callable(getattr(keras.layers.BatchNormalization, _keras.BATCHNORM_MOMENTS))
    fixed = instead(lambda inputs, mask: (tf.zeros(2), tf.ones(2)))
    with Replaced([(norm, _keras.BATCHNORM_MOMENTS, fixed)]):
        np.testing.assert_allclose(norm(x, training=True), x)  # mean 0, variance 1: unchanged
        np.testing.assert_allclose(other(x, training=True), [[-1, -1], [1, 1]], atol=1e-3)
    np.testing.assert_allclose(norm(x, training=True), [[-1, -1], [1, 1]], atol=1e-3)


def _ask():
    return _keras.called_by_spatial_dropout()


class _SpatialProbe(keras.layers.SpatialDropout1D):
    def call(self, inputs, training=False):
        return _ask()


class _DropoutProbe(keras.layers.Dropout):
    def call(self, inputs, training=False):
        return _ask()


def test_spatial_dropout_caller_is_found():
    assert _SpatialProbe(0.5).call(None) is True
    assert _DropoutProbe(0.5).call(None) is False
    assert _ask() is False  # no Keras layer up the stack


# --- no private Keras API outside _keras.py ---------------------------------------------------
PACKAGE = Path(_keras.__file__).parent


# Calls that reach an attribute by its name: a private one named so is taken for Keras's (a
# Keras object's attributes are reached by name where they may be missing; hyparflow's own
# are named `_hyparflow_...`).
BY_NAME = {"getattr", "hasattr", "setattr", "delattr", "__setattr__", "__delattr__"}


def _private_name(node) -> str | None:
    """The private attribute name a call such as getattr(layer, "_x") reaches, if any."""
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return None
    function = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
    value = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
    if function not in BY_NAME or not isinstance(value, str):
        return None
    if value.startswith("_") and not value.startswith("__") and "hyparflow" not in value:
        return f"{function}(..., {value!r})"
    return None


def _private_use(node) -> str | None:
    """What `node` reaches of Keras's private API: keras.src (imported, walked or named as a
    module to import), a private attribute by name, or the caller's stack (sys._getframe,
    which only walks Keras's frames)."""
    if isinstance(node, ast.Call):
        return _private_name(node)
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        names = [f"{node.module}.{alias.name}" for alias in node.names]
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        names = [f"{node.value.id}.{node.attr}"]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        names = [node.value]  # importlib.import_module("keras.src...")
    else:
        return None
    for name in names:
        if re.fullmatch(r"keras\.src(\..*)?|sys\._getframe", name):
            return name
    return None


def _private_uses(root: Path) -> list[str]:
    """'path:line name' of every private Keras use in the modules under `root` but _keras.py."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "_keras.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = _private_use(node)
            if name:
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_private_keras_only_in_one_module():
    assert _private_uses(PACKAGE) == []


@pytest.mark.parametrize(
    "line",
    [
        "from keras.src import ops",
        "import keras.src.backend as backend",
        "from keras import src",
        "import keras\nops = keras.src.ops",
        "import importlib\nimportlib.import_module('keras.src.ops')",
        "import sys\nframe = sys._getframe(1)",
        "def f(layer):\n    return getattr(layer, '_tracker', None)",
        "def f(layer):\n    object.__setattr__(layer, '_moments', None)",
    ],
)
def test_a_planted_private_use_is_found(tmp_path, line):
    (tmp_path / "_keras.py").write_text(line)  # allowed there
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "planted.py").write_text(f'"""keras.src in prose is fine."""\n{line}\n')
    assert [use.split(" ")[0] for use in _private_uses(tmp_path)] == [
        f"engine{os.sep}planted.py:{1 + line.count(chr(10)) + 1}"
    ]


def test_call_state_entries():
    """What a ZeRO-3 layer boundary replays: the stateless scope, the call context and the
    autocast scope a layer's call ran under; and a loss counted as a layer's own."""
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    seen = {}

    class Probe(keras.layers.Layer):
        def call(self, x, training=None):
            seen.update(_keras.call_state())
            return x

    Probe(dtype="mixed_float16")(np.zeros((1, 3), "float32"), training=True)
    assert seen["current_call_ctx"].training is True
    assert seen["autocast_scope"].dtype == "float16"
    assert _keras.call_state()["current_call_ctx"] is None  # reset after the call
    with _keras.calling_under(seen):
        assert _keras.call_state()["current_call_ctx"] is seen["current_call_ctx"]
    assert _keras.call_state()["current_call_ctx"] is None
    assert _keras.current_stateless_scope() is None
    with keras.StatelessScope(collect_losses=True) as scope:
        assert _keras.current_stateless_scope() is scope
        loss = keras.ops.ones(())
        scope.add_loss(loss)
        _keras.own_loss(layer, loss)
        assert _keras.own_losses(layer) == [loss]
