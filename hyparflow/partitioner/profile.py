"""Measured costs: forward+backward time of each node, and of each stage, on a sample batch."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow import _keras
from hyparflow.partitioner.graph import LayerGraph
from hyparflow.traced import traced

DEFAULT_PROFILE_BATCH = 32
SLOW_CALL_SECONDS = 0.1  # a call this long is timed once (`best_time`)


def make_sample(graph: LayerGraph, sample=None, input_shape=None, batch_size=None) -> list:
    """Flat list of input tensors (model.inputs order) to profile on.

    `sample` is anything the model accepts; otherwise random inputs are made from
    `input_shape` (one shape without the batch dimension, a list of them, one per input, or a
    dict of them by input name) or the model's input shapes, with `batch_size` rows (default
    32).
    """
    if sample is not None:
        return _keras.standardize_inputs(graph.root, sample)
    specs = [graph.tensors[t].keras_tensor for t in graph.inputs]
    if isinstance(input_shape, dict):
        shapes = _shapes_by_name(graph, input_shape)
    elif input_shape is not None:
        shapes = [input_shape] if _is_single_shape(input_shape) else list(input_shape)
        if len(shapes) != len(specs):
            raise ValueError(
                f"input_shape gives {len(shapes)} shapes but the model has {len(specs)} inputs; "
                "pass one shape (without the batch dimension) per input."
            )
    else:
        shapes = [tuple(spec.shape[1:]) for spec in specs]
    batch = batch_size or DEFAULT_PROFILE_BATCH
    rng = np.random.default_rng(0)
    values = []
    for spec, shape in zip(specs, shapes, strict=True):
        if any(d is None for d in shape):
            raise ValueError(
                f"Model input '{spec.name}' has unknown dimensions {tuple(spec.shape)}; pass "
                "input_shape=(...) without the batch dimension, or sample=a batch of inputs."
            )
        full = (batch, *shape)
        if np.dtype(_numpy_name(spec.dtype)).kind == "f":
            array = rng.standard_normal(full).astype(_numpy_name(spec.dtype))
        else:
            array = np.zeros(full, dtype=_numpy_name(spec.dtype))  # safe for embeddings/lookups
        values.append(tf.convert_to_tensor(array, dtype=spec.dtype))
    return values


def _shapes_by_name(graph: LayerGraph, input_shape: dict) -> list:
    """The shapes of a dict keyed by the model's input names (as keras_hub's models take
    their data), in `model.inputs`' order."""
    structure = graph.root.input
    if not isinstance(structure, dict):
        raise ValueError(
            f"input_shape is a dict {sorted(input_shape)}, but the model takes its inputs "
            "as a list; pass one shape per input, in model.inputs' order."
        )
    name_of = {id(tensor): name for name, tensor in structure.items()}
    names = [name_of[id(graph.tensors[t].keras_tensor)] for t in graph.inputs]
    missing = [name for name in names if name not in input_shape]
    if missing:
        raise ValueError(f"input_shape gives no shape for the model's inputs {missing}.")
    return [tuple(input_shape[name]) for name in names]


def node_times(graph: LayerGraph, inputs: list, repeats: int = 5) -> np.ndarray:
    """Seconds of forward plus backward of each node on `inputs` (training mode), each compiled
    alone with tf.function; the cost of an empty compiled call is subtracted."""
    overhead = best_time(traced(lambda xs: [tf.identity(x) for x in xs]), inputs, repeats)
    times = np.zeros(len(graph.nodes))
    with preserved_state(graph.model):
        for node, node_inputs in node_inputs_in_order(graph, inputs):
            step = forward_backward(node_call(node), _trainable(node.operation))
            times[node.position] = max(0.0, best_time(step, node_inputs, repeats) - overhead)
    return times


def node_inputs_in_order(graph: LayerGraph, inputs: list):
    """Yield each node with its input tensors, running it once (eagerly, training mode) to
    feed the nodes after it; activations are freed once their last reader has run."""
    values = dict(zip(graph.inputs, inputs, strict=True))
    for node in graph.nodes:
        node_inputs = [values[t] for t in node.inputs]
        yield node, node_inputs
        outputs = node_call(node)(node_inputs)
        values.update(zip(node.outputs, outputs, strict=True))
        for t in node.inputs:  # free activations nobody reads any more
            if graph.tensors[t].consumers[-1] == node.position and t not in graph.outputs:
                values.pop(t, None)


def stage_times(stages, inputs: list, model, repeats: int = 5) -> list[float]:
    """Seconds of forward plus backward of each stage's model, fed by the previous stage.

    Stages are timed in turns, so a slow spell on a shared machine hits all of them alike.
    """
    steps, stage_inputs = [], []
    with preserved_state(model):
        for stage in stages:
            step = forward_backward(
                lambda xs, m=stage.model: _as_list(m(xs, training=True)),
                stage.model.trainable_variables,
            )
            calls = _calibrate(step, inputs)
            steps.append((step, inputs, calls))
            stage_inputs.append(inputs)
            inputs = stage.forward(inputs, training=True)
        samples = [[] for _ in stages]
        for _ in range(repeats):
            for i, (step, step_inputs, calls) in enumerate(steps):
                samples[i].append(_time_calls(step, step_inputs, calls))
    return [min(s) for s in samples]


@contextlib.contextmanager
def preserved_state(model):
    """Restore every variable (BatchNormalization statistics, RNG seeds) after profiling."""
    saved = [(v, v.numpy()) for v in model.variables]
    try:
        yield
    finally:
        for variable, value in saved:
            variable.assign(value)


def node_call(node, operation=None):
    """Function running one node on the list of its input tensors, in training mode; with
    `operation`, that one in the node's place (a copy of its layer, built alone)."""
    positions = {t: i for i, t in enumerate(node.inputs)}
    operation = node.operation if operation is None else operation

    def call(inputs):
        lookup = {kt_id: inputs[positions[t]] for kt_id, t in node.argument_tensors.items()}
        args, kwargs = node.arguments.fill_in(lookup)
        # as Keras's Functional does: hand the training flag to operations that take it
        if "training" in _keras.call_context_args(operation):
            kwargs = {**kwargs, "training": True}
        return tree.flatten(operation(*args, **kwargs))

    return call


def forward_backward(call, variables):
    """Compiled forward and backward: gradients of all outputs (seeded with ones) with respect
    to the floating-point inputs and `variables`."""

    @traced
    def step(inputs):
        floats = [x for x in inputs if x.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(floats)
            outputs = call(inputs)
        targets = [y for y in outputs if y.dtype.is_floating]
        sources = floats + list(variables)
        if not targets or not sources:
            return outputs
        seeds = [tf.ones_like(y) for y in targets]
        grads = tape.gradient(targets, sources, output_gradients=seeds)
        return outputs, [g for g in grads if g is not None]

    return step


def best_time(function, inputs, repeats):
    """Fastest of `repeats` timings: interference on a shared machine only ever adds time.
    A call of `SLOW_CALL_SECONDS` or more is timed once: noise is small beside it, and each
    repeat would cost as long (a large model's layer, timed alone)."""
    calls, single = _calibrated(function, inputs)
    if single >= SLOW_CALL_SECONDS:
        return single
    return min(_time_calls(function, inputs, calls) for _ in range(repeats))


def _calibrate(function, inputs) -> int:
    """Trace and warm up `function`; returns how many calls make one timing of >= ~2 ms."""
    return _calibrated(function, inputs)[0]


def _calibrated(function, inputs) -> tuple[int, float]:
    """`_calibrate`'s count of calls, and the seconds of one call."""
    _sync(function(inputs))
    single = _time_calls(function, inputs, 1)
    return int(min(20, max(1, 2e-3 / max(single, 1e-9)))), single


def _time_calls(function, inputs, calls) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        result = function(inputs)
    _sync(result)
    return (time.perf_counter() - start) / calls


def _sync(result):
    """Wait for asynchronous (GPU) work behind `result`."""
    flat = [x for x in tree.flatten(result) if hasattr(x, "numpy")]
    if flat:
        tf.reshape(flat[0], [-1])[:1].numpy()


def _trainable(operation):
    return list(getattr(operation, "trainable_variables", []))


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _is_single_shape(shape) -> bool:
    return all(d is None or isinstance(d, (int, np.integer)) for d in shape)


def _numpy_name(dtype) -> str:
    return {"bfloat16": "float32"}.get(str(dtype), str(dtype))
