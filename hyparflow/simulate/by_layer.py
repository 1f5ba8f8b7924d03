"""A model's `ModelCosts` without running the model: each distinct layer built alone and timed.

`measure.py` runs the whole model, so it needs its weights: a model built under `hf.scope()`
holds none, and a large one would not fit in one process anyway. Here the graph is traced once
at the data's shapes (placeholders for weights, nothing allocated), which gives every node's
input shapes. Nodes are grouped by what their time depends on (`layer_key`: the layer's class,
its config without its name, its inputs' shapes and dtypes and its call's other arguments),
and each group's first layer is copied from its config, built alone at those shapes, timed
forward and forward plus backward at two batch sizes, and freed before the next: repeated
blocks are timed once, and the memory held is the largest layer's, never the model's.

What a stage pays around its layers (a call's launch, the optimizer per variable and per
byte, summing micro-batches) does not depend on the model's size: `engine_proxy.py` times it
on a small stand-in with the model's optimizer. The loss is the model's own, timed on outputs
of the traced shapes. The whole model's one-call step and plain `model.fit` are not timed
(`fused` and `single_process` stay None: the scaling model prices P = 1 from the layers).
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import replace

import keras
import tensorflow as tf

from hyparflow import _keras, deferred
from hyparflow.partitioner import cost, profile
from hyparflow.partitioner.graph import build_graph
from hyparflow.partitioner.traced_shapes import traced_specs
from hyparflow.simulate.costs import Affine, LayerCost, ModelCosts
from hyparflow.simulate.engine_proxy import engine_costs
from hyparflow.simulate.measure import (
    median_seconds,
    timing_facts,
    variable_bytes,
    zero_targets,
)
from hyparflow.traced import traced

REPEATS = 3  # timings of each distinct layer at each batch size; the fastest counts
# a layer this slow at the larger batch is all per-sample work (its launch costs microseconds):
# the smaller batch is its share of the larger's time, not timed again (seconds each on CPUs)
ALL_PER_SAMPLE_SECONDS = 0.5


def measure_by_layer(model, batch_sizes, input_shape=None, repeats=REPEATS) -> ModelCosts:
    """`ModelCosts` of a compiled functional or Sequential `model` (built under `hf.scope()`
    or not; each layer is timed on a copy, so its weights are not read, but for a layer whose
    config cannot rebuild it, `_fresh`) at two `batch_sizes` of inputs shaped `input_shape`
    (as `profile.make_sample` takes it; None: the model's own)."""
    if getattr(model, "optimizer", None) is None:
        raise ValueError("measure_by_layer needs a compiled model (model.compile(...) first)")
    small, large = sorted(int(b) for b in batch_sizes)
    if small == large:
        raise ValueError(f"batch_sizes needs two different sizes, got {batch_sizes}")
    started = time.perf_counter()
    graph = build_graph(model)
    specs = {b: _specs(graph, input_shape, b) for b in (small, large)}
    timed, seen, layers = {}, set(), []
    for node in graph.nodes:
        key = layer_key(node, specs[small])
        if key not in timed:
            timed[key] = _time_alone(node, {b: specs[b] for b in (small, large)}, repeats)
        owned = node.is_layer and id(node.operation) not in seen  # parameters at first call
        seen.add(id(node.operation))
        variables = list(node.operation.trainable_variables) if owned else []
        forward, backward = timed[key]
        layers.append(
            LayerCost(
                node.name, forward, backward, sum(map(variable_bytes, variables)), len(variables)
            )
        )
    engine = replace(engine_costs(model.optimizer), loss=_loss_cost(model, graph, specs, repeats))
    measured = {
        **timing_facts(small, large),
        "by_layer": {"distinct": len(timed), "seconds": time.perf_counter() - started},
    }
    cuts = [float(c) for c in cost.cut_bytes_per_sample(graph)]
    return ModelCosts(model.name, layers, cuts, engine, None, measured, None)


def _specs(graph, input_shape, batch: int) -> dict:
    """Every tensor's spec at `batch` samples of inputs shaped `input_shape`."""
    sample = profile.make_sample(graph, input_shape=input_shape, batch_size=batch)
    return traced_specs(graph, [tf.TensorSpec(x.shape, x.dtype) for x in sample])


def layer_key(node, specs: dict) -> str:
    """What a node's time depends on: its operation's class and config (without the name,
    which differs between repeated blocks), its inputs' shapes and dtypes, and its call's other
    arguments. Nodes with equal keys take equal times."""
    operation = node.operation
    try:
        config = operation.get_config()
    except Exception:  # noqa: BLE001 - one that cannot say (keras_hub's Llama block): its own key
        config = {"id": id(operation)}
    config = {k: v for k, v in config.items() if k != "name"}
    labels = {kt_id: f"<{_spec_text(specs[t])}>" for kt_id, t in node.argument_tensors.items()}
    args, kwargs = node.arguments.fill_in(labels)
    kind = f"{type(operation).__module__}.{type(operation).__qualname__}"
    return json.dumps([kind, config, repr(args), repr(sorted(kwargs.items()))], default=repr)


def _spec_text(spec) -> str:
    return f"{spec.dtype.name}{spec.shape.as_list()[1:]}" if hasattr(spec, "shape") else repr(spec)


def _time_alone(node, specs: dict, repeats: int) -> tuple[Affine, Affine]:
    """The forward and backward lines of `node`'s layer, copied from its config and built
    alone at the shapes of `specs` (batch size -> tensor specs); the copy is freed after."""
    seconds = _seconds_alone(node, specs, repeats)
    gc.collect()  # the copy's weights go before the next layer's are made
    (small, a), (large, b) = sorted(seconds.items())
    return Affine.through(small, a[0], large, b[0]), Affine.through(small, a[1], large, b[1])


def _seconds_alone(node, specs: dict, repeats: int) -> dict:
    """Batch size -> (forward, backward) seconds of a fresh copy of `node`'s layer, each less
    an empty compiled call's."""
    operation = _fresh(node.operation)
    own = operation is node.operation  # a Dropout's seed, a layer timed in place: put back
    saved = [(v, v.numpy()) for v in getattr(operation, "variables", [])] if own else []
    try:
        return _timings(node, operation, specs, repeats)
    finally:
        for variable, value in saved:
            variable.assign(value)


def _timings(node, operation, specs: dict, repeats: int) -> dict:
    """`_seconds_alone`'s timings of `operation` in `node`'s place."""
    call = profile.node_call(node, operation)
    inputs = {b: [_random(s[t]) for t in node.inputs] for b, s in specs.items()}
    call(inputs[min(inputs)])  # builds the copy's weights
    forward = traced(call)
    both = profile.forward_backward(call, list(getattr(operation, "trainable_variables", [])))
    empty = traced(lambda xs: [tf.identity(x) for x in xs])
    seconds = {}
    for batch in sorted(inputs, reverse=True):  # the largest first: it may serve for both
        if seconds and sum(seconds[max(seconds)]) >= ALL_PER_SAMPLE_SECONDS:
            large = max(seconds)
            seconds[batch] = tuple(t * batch / large for t in seconds[large])
            continue
        xs = inputs[batch]
        overhead = profile.best_time(empty, xs, repeats)
        f = max(0.0, profile.best_time(forward, xs, repeats) - overhead)
        fb = max(f, profile.best_time(both, xs, repeats) - overhead)
        seconds[batch] = (f, fb - f)
    return seconds


def _fresh(operation):
    """A new layer like `operation`, its variables unbuilt (`operation` itself if it has none:
    a keras.ops call or a layer without state runs as it is; a Dropout's seed is state). A
    layer whose config cannot rebuild it (keras_hub 0.2x's Llama block misses a field of its
    own config) is timed as it is where it holds its weights (its state put back after);
    else this raises ValueError."""
    variables = list(getattr(operation, "variables", []))
    if not variables:
        return operation
    try:
        return operation.__class__.from_config(operation.get_config())
    except Exception as error:  # noqa: BLE001 - any: said below, or the layer itself timed
        if any(deferred.is_deferred(v) for v in variables):
            raise ValueError(
                f"layer {operation.name!r} cannot be rebuilt from its config to be timed "
                f"({type(error).__name__}: {error}) and holds no weights (hf.scope())"
            ) from error
        return operation


def _random(spec):
    """A tensor of `spec`: normal floats, zeros for integers (safe for lookups), True masks."""
    shape = spec.shape.as_list()
    if spec.dtype.is_floating:
        return tf.random.normal(shape, dtype=spec.dtype)
    if spec.dtype == tf.bool:
        return tf.ones(shape, tf.bool)
    return tf.zeros(shape, spec.dtype)


def _loss_cost(model, graph, specs: dict, repeats: int) -> Affine:
    """The compiled loss on random outputs of the traced shapes, at both batch sizes."""
    loss = _keras.compiled_loss(model)
    seconds = {}
    for batch, found in specs.items():
        outputs = [_random(found[t]) for t in graph.outputs]
        y_pred = keras.tree.pack_sequence_as(graph.root.output, outputs)
        y = zero_targets(model, y_pred)
        seconds[batch] = median_seconds(traced(lambda a, b: loss(a, b, None)), repeats, y, y_pred)
    (small, a), (large, b) = sorted(seconds.items())
    return Affine.through(small, a, large, b)
