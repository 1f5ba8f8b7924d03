"""Measure a Keras model's `ModelCosts` on this machine (TensorFlow; one process, no MPI).

Per layer: the forward, and the forward plus backward, of each layer call compiled alone and
timed on random inputs at two batch sizes (the partitioner's profiler, `balance="time"`; the
fastest of several timings, since interference only adds time), giving each an affine cost in
the batch. Around the layers: the engine's own `StageRunner` on the whole model, its gradient
accumulation and the eager optimizer update, compared with the layers' sum, give the engine's
per-call costs. A plain `model.fit` step on a copy of the model gives the one-rank baseline.
Run it with the thread settings the training ranks will use (`TF_NUM_INTRAOP_THREADS`).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time

import numpy as np

from hyparflow.simulate.costs import Affine, EngineCosts, LayerCost, ModelCosts

DEFAULT_BATCH_SIZES = (16, 64)


def measure_model(
    model,
    batch_sizes: tuple[int, int] = DEFAULT_BATCH_SIZES,
    input_shape=None,
    repeats: int = 7,
    fit_steps: int = 8,
) -> ModelCosts:
    """Per-layer and engine costs of a compiled functional or Sequential Keras `model`.

    The model's weights and optimizer are left as they were (the fit baseline trains a copy).

    Example:
        >>> costs = measure_model(model, batch_sizes=(16, 64))
        >>> costs.save("costs.json")   # then: hyparflow simulate costs.json ...
    """
    import keras
    import tensorflow as tf

    from hyparflow.partitioner import cost, profile
    from hyparflow.partitioner.graph import build_graph

    if getattr(model, "optimizer", None) is None:
        raise ValueError("measure_model needs a compiled model (model.compile(...) first)")
    small, large = sorted(int(b) for b in batch_sizes)
    graph = build_graph(model)
    forward, both = {}, {}
    for batch in (small, large):
        inputs = profile.make_sample(graph, input_shape=input_shape, batch_size=batch)
        forward[batch] = _forward_times(graph, inputs, repeats)
        both[batch] = profile.node_times(graph, inputs, repeats)
    layers = []
    seen = set()
    for node in graph.nodes:
        i = node.position
        variables = []
        if node.is_layer and id(node.operation) not in seen:
            seen.add(id(node.operation))
            variables = list(node.operation.trainable_variables)
        backward = {b: max(0.0, both[b][i] - forward[b][i]) for b in (small, large)}
        layers.append(
            LayerCost(
                name=node.name,
                forward=Affine.through(small, forward[small][i], large, forward[large][i]),
                backward=Affine.through(small, backward[small], large, backward[large]),
                param_bytes=sum(_nbytes(v) for v in variables),
                variables=len(variables),
            )
        )
    costs = ModelCosts(
        name=model.name,
        layers=layers,
        cut_bytes=[float(b) for b in cost.cut_bytes_per_sample(graph)],
    )
    with profile.preserved_state(model):
        costs.engine = _engine_costs(model, graph, costs, (small, large), repeats, input_shape)
    costs.single_process = _fit_step(model, (small, large), fit_steps, input_shape)
    costs.measured = {
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "batch_sizes": [small, large],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return costs


def _forward_times(graph, inputs, repeats) -> np.ndarray:
    """Seconds of each node's forward alone (training mode), the empty call subtracted."""
    import tensorflow as tf

    from hyparflow.partitioner import profile

    empty = tf.function(lambda xs: [tf.identity(x) for x in xs])
    overhead = profile._best_time(empty, inputs, repeats)
    values = dict(zip(graph.inputs, inputs))
    times = np.zeros(len(graph.nodes))
    with profile.preserved_state(graph.model):
        for node in graph.nodes:
            node_inputs = [values[t] for t in node.inputs]
            call = profile._node_call(node)
            values.update(zip(node.outputs, call(node_inputs)))
            elapsed = profile._best_time(tf.function(call), node_inputs, repeats)
            times[node.position] = max(0.0, elapsed - overhead)
            for t in node.inputs:  # free activations nobody reads any more
                if graph.tensors[t].consumers[-1] == node.position and t not in graph.outputs:
                    values.pop(t, None)
    return times


def _engine_costs(model, graph, costs, batch_sizes, repeats, input_shape) -> EngineCosts:
    """The engine's costs around the layers, from its own StageRunner on the whole model.

    A middle stage (no loss; output gradients given) shows the per-call costs of the forward
    and the backward; the last stage's forward adds the loss and metrics.
    """
    import tensorflow as tf

    from hyparflow.engine.stage import StageRunner
    from hyparflow.partitioner import profile

    variables = list(model.trainable_variables)
    call = lambda xs, training: model(xs, training=training)  # noqa: E731
    middle = StageRunner(call, variables)
    last = StageRunner(call, variables, loss=model._compile_loss)
    metrics = tf.function(_metric_update(model))
    forward_call, backward_call, loss = [], [], {}
    for batch in batch_sizes:
        inputs = profile.make_sample(graph, input_shape=input_shape, batch_size=batch)
        x = inputs if len(inputs) > 1 else inputs[0]
        y_pred = model(x, training=False)
        y = _targets(y_pred)
        seeds = [tf.ones_like(t) for t in tf.nest.flatten(y_pred)]

        def middle_step(x=x, seeds=seeds):
            t0 = time.perf_counter()
            middle.forward(0, x)
            t1 = time.perf_counter()
            middle.backward(0, seeds)
            middle.take_gradients()[0].numpy()
            return t1 - t0, time.perf_counter() - t1

        def last_forward(x=x, y=y):
            t0 = time.perf_counter()
            y_pred, value = last.forward(0, x, (y, None), 1.0)
            metrics(y, y_pred)
            float(value)
            elapsed = time.perf_counter() - t0
            last._pending.clear()
            return elapsed

        timings = _repeat(middle_step, repeats, timed_by_itself=True)
        f_layers = sum(lc.forward.at(batch) for lc in costs.layers)
        b_layers = sum(lc.backward.at(batch) for lc in costs.layers)
        forward_call.append(min(t[0] for t in timings) - f_layers)
        backward_call.append(min(t[1] for t in timings) - b_layers)
        loss[batch] = min(_repeat(last_forward, repeats, timed_by_itself=True)) - min(
            t[0] for t in timings
        )
    small, large = batch_sizes
    grads = [tf.zeros_like(v) for v in variables]
    accumulate = min(_repeat(lambda: [a + g for a, g in zip(grads, grads)], repeats))
    optimizer = _optimizer_costs(model, repeats)
    return EngineCosts(
        forward_call=max(0.0, statistics.mean(forward_call)),
        backward_call=max(0.0, statistics.mean(backward_call)),
        loss=Affine.through(small, loss[small], large, loss[large]),
        accumulate_per_variable=accumulate / max(1, len(grads)),
        **optimizer,
    )


def _optimizer_costs(model, repeats) -> dict:
    """Eager `apply_gradients` on several subsets of the variables (a fresh copy of the
    optimizer each, as each stage has its own), fitted as fixed + per variable + per byte."""
    import keras
    import tensorflow as tf

    variables = list(model.trainable_variables)
    if not variables:
        return {}
    by_size = sorted(variables, key=_nbytes)
    subsets = [variables, by_size[: max(1, len(by_size) // 2)], by_size[len(by_size) // 2 :]]
    subsets += [by_size[-1:], by_size[:1]]
    rows, seconds = [], []
    for subset in subsets:
        optimizer = keras.optimizers.deserialize(keras.optimizers.serialize(model.optimizer))
        grads = [tf.zeros_like(v) for v in subset]
        copies = [keras.Variable(v.numpy(), dtype=v.dtype) for v in subset]

        def update(optimizer=optimizer, grads=grads, copies=copies):
            optimizer.apply_gradients(zip(grads, copies))

        update()  # builds the optimizer's slots
        rows.append([1.0, len(subset), sum(_nbytes(v) for v in subset)])
        seconds.append(min(_repeat(update, repeats)))
    fixed, per_variable, per_byte = np.linalg.lstsq(np.array(rows), np.array(seconds), rcond=None)[
        0
    ]
    return {
        "optimizer_fixed": max(0.0, float(fixed)),
        "optimizer_per_variable": max(0.0, float(per_variable)),
        "optimizer_per_byte": max(0.0, float(per_byte)),
    }


def _fit_step(model, batch_sizes, steps, input_shape) -> Affine:
    """Seconds of one `model.fit` step (batch begin to batch end, as the profiler times a
    single process) on a copy of the model, at both batch sizes."""
    import keras

    from hyparflow.partitioner import profile
    from hyparflow.partitioner.graph import build_graph

    clone = keras.models.clone_model(model)
    clone.compile_from_config(model.get_compile_config())
    graph = build_graph(clone)
    timer = _StepTimer()
    medians = {}
    for batch in batch_sizes:
        inputs = profile.make_sample(graph, input_shape=input_shape, batch_size=batch * steps)
        x = [np.asarray(t) for t in inputs]
        y = _targets(clone(x[0] if len(x) == 1 else x, training=False), as_numpy=True)
        x = x[0] if len(x) == 1 else x
        clone.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # traces
        timer.times = []
        clone.fit(x, y, batch_size=batch, epochs=2, verbose=0, callbacks=[timer])
        medians[batch] = statistics.median(timer.times)
    small, large = batch_sizes
    return Affine.through(small, medians[small], large, medians[large])


class _StepTimer:
    """A Keras callback recording each batch's begin-to-end seconds (built lazily so that
    importing this module does not import Keras)."""

    def __new__(cls):
        import keras

        class StepTimer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.times, self._start = [], 0.0

            def on_train_batch_begin(self, batch, logs=None):
                self._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.times.append(time.perf_counter() - self._start)

        return StepTimer()


def _metric_update(model):
    def update(y, y_pred):
        if model._compile_metrics is not None:
            model._compile_metrics.update_state(y, y_pred, None)
        return 0

    return update


def _targets(y_pred, as_numpy=False):
    """Class-index targets for a classifier's output, else targets shaped like the output
    (random data: only the costs matter)."""
    import tensorflow as tf

    outputs = tf.nest.flatten(y_pred)
    made = []
    for out in outputs:
        if len(out.shape) == 2 and out.shape[-1] > 1:
            value = np.zeros(out.shape[0], dtype="int64")
        else:
            value = np.zeros(out.shape, dtype="float32")
        made.append(value if as_numpy else tf.convert_to_tensor(value))
    return made[0] if len(made) == 1 else made


def _repeat(function, repeats, timed_by_itself=False):
    """Seconds of `repeats` calls after a warm-up (tracing) call; `timed_by_itself`: the
    function returns its own timing instead."""
    function()
    results = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        results.append(result if timed_by_itself else time.perf_counter() - start)
    return results


def _nbytes(variable) -> int:
    return math.prod(variable.shape) * np.dtype(_numpy_dtype(variable.dtype)).itemsize


def _numpy_dtype(dtype) -> str:
    name = getattr(dtype, "name", str(dtype))
    return {"bfloat16": "float16"}.get(name, name)
