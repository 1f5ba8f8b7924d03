"""Checks shared by the partitioner tests: the contract a plan must meet for the engine."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import tree


def check_plan(model, plan, x, num_partitions, training=False, gradients=True, expected=None):
    """Assert the whole contract of `plan` for `model` on inputs `x`."""
    assert len(plan.stages) == num_partitions
    check_chain(model, plan)
    check_layer_coverage(plan, expected if expected is not None else leaf_layer_names(model))
    check_outputs(model, plan, x, training)
    if gradients:
        check_gradients(model, plan, x, training)


def check_chain(model, plan):
    """Stage 0 takes model.inputs; each stage takes what the previous one sends; the last one
    sends model.outputs; receives/sends describe the stage models' inputs/outputs."""
    stages = plan.stages
    assert [id(t) for t in stages[0].model.inputs] == [id(t) for t in model.inputs]
    # consecutive pairs: the shifted copy is one shorter, hence strict=False
    for previous, stage in zip(stages, stages[1:], strict=False):
        assert _specs(stage.model.inputs) == _specs(previous.model.outputs)
        assert stage.receives == previous.sends
    assert _specs(stages[-1].model.outputs) == _specs(model.outputs)
    for stage in stages:
        for boundary, tensor in zip(stage.receives, stage.model.inputs, strict=True):
            assert (boundary.shape, boundary.dtype) == _specs([tensor])[0]
        for boundary, tensor in zip(stage.sends, stage.model.outputs, strict=True):
            assert (boundary.shape, boundary.dtype) == _specs([tensor])[0]
            assert boundary.forwarded == (boundary.source_stage != stage.index)
        assert len({b.name for b in stage.sends}) == len(stage.sends)
    for boundary in stages[-1].sends:
        assert boundary.dest_stage == -1


def check_layer_coverage(plan, expected_names):
    """Every layer or op is computed by exactly one stage, unless listed as shared."""
    seen = {}
    for stage in plan.stages:
        for name in stage.layers + stage.ops:
            seen.setdefault(name, []).append(stage.index)
    assert set(seen) == set(expected_names), set(seen) ^ set(expected_names)
    for name, where in seen.items():
        if len(where) > 1:
            assert plan.shared_layers[name] == where
        else:
            assert name not in plan.shared_layers


def check_outputs(model, plan, x, training=False):
    expected = model(x, training=training)
    got = plan.run(x, training=training)
    assert tree.lists_to_tuples(_structure(got)) == tree.lists_to_tuples(_structure(expected))
    for e, g in zip(tree.flatten(expected), tree.flatten(got), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-6)
    # the stages chained by hand, as the engine does
    values = [tf.convert_to_tensor(v) for v in tree.flatten(x)]
    for stage in plan.stages:
        values = stage.forward(values, training=training)
    for e, g in zip(tree.flatten(expected), values, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-6)


def check_gradients(model, plan, x, training=False):
    """Gradients of a loss through the chained stages equal those through the model."""
    variables = model.trainable_variables
    assert variables
    full = _gradients(lambda: model(x, training=training), variables)
    chained = _gradients(lambda: plan.run(x, training=training), variables)
    for v, f, c in zip(variables, full, chained, strict=True):
        assert (f is None) == (c is None), v.path
        if f is not None:
            scale = max(1.0, float(np.max(np.abs(f))))
            np.testing.assert_allclose(c, f, rtol=1e-5, atol=1e-5 * scale, err_msg=v.path)


def leaf_layer_names(model) -> set:
    """Names of all layers and ops of a model, nested functional models flattened as
    "outer/inner" (what the partitioner reports), inputs left out."""
    names = set()
    pending = [(model, "")]
    while pending:
        current, prefix = pending.pop()
        graph = current._functional if isinstance(current, keras.Sequential) else current
        for operation in graph.operations:
            if isinstance(operation, keras.layers.InputLayer):
                continue
            nested = isinstance(operation, keras.Model) and hasattr(
                getattr(operation, "_functional", operation), "_nodes_by_depth"
            )
            if nested:
                pending.append((operation, f"{prefix}{operation.name}/"))
            else:
                names.add(prefix + operation.name)
    return names


def _gradients(forward, variables):
    with tf.GradientTape() as tape:
        outputs = tree.flatten(forward())
        loss = sum(tf.reduce_sum(tf.square(tf.cast(y, "float32"))) for y in outputs)
    return [None if g is None else np.asarray(g) for g in tape.gradient(loss, variables)]


def _specs(tensors):
    return [(tuple(t.shape[1:]), str(t.dtype)) for t in tensors]


def _structure(x):
    return tree.map_structure(lambda _: 0, x)
