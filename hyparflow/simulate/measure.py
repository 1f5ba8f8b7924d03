"""Measure a Keras model's `ModelCosts` on this machine (TensorFlow; one process, no MPI).

Each layer call is timed alone, forward plus backward, at two batch sizes (as `balance="time"`
times them): its growth with the batch is the layer's share of the work. Stages are then run
as the engine runs them (`_stage_step`), on the whole model and on 2- and 4-way splits, and a
non-negative least-squares fit (`_fit_stages`) turns the shares into what a stage pays. The
loss, the unpartitioned step, the logs' read-out and a plain `model.fit` step (the one-rank
baseline) are timed as they are. Run it with the ranks' threads (`TF_NUM_INTRAOP_THREADS`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import platform
import statistics
import time
import timeit

import keras
import numpy as np
import tensorflow as tf

from hyparflow import _keras
from hyparflow.partitioner import cost, partition, profile
from hyparflow.partitioner.graph import build_graph
from hyparflow.simulate.costs import Affine, EngineCosts, LayerCost, ModelCosts
from hyparflow.traced import traced

DEFAULT_BATCH_SIZES = (16, 64)
SPLITS = (2, 4)  # stage variants the engine costs are fitted on (besides the whole model)
REPEATS = 5  # timings per layer, the fastest counts (interference only adds time)
STAGE_REPEATS = 9  # timings per stage step, loss and unpartitioned step; the median counts


def measure_model(
    model,
    batch_sizes=DEFAULT_BATCH_SIZES,
    input_shape=None,
    fit_batch_sizes=None,
    repeats=(REPEATS, STAGE_REPEATS),
) -> ModelCosts:
    """Per-layer and engine costs of a compiled functional or Sequential Keras `model`, at
    two `batch_sizes`; its weights are restored afterwards. The `model.fit` baseline (on a
    copy) runs at `fit_batch_sizes` (default `batch_sizes`: give those one rank trains at;
    `()`: none). `repeats`: timings per layer, and per stage step, loss and fused step.

    For example:
        costs = measure_model(model, batch_sizes=(16, 64))
        costs.save("costs.json")   # then: hyparflow simulate costs.json ...
    """
    if getattr(model, "optimizer", None) is None:
        raise ValueError("measure_model needs a compiled model (model.compile(...) first)")
    small, large = sorted(int(b) for b in batch_sizes)
    if small == large:
        raise ValueError(f"batch_sizes needs two different sizes, got {batch_sizes}")
    started = (time.process_time(), time.perf_counter())
    graph = build_graph(model)
    samples = {
        b: profile.make_sample(graph, input_shape=input_shape, batch_size=b) for b in (small, large)
    }
    layer_repeats, stage_repeats = repeats
    with profile.preserved_state(model):
        times = {b: profile.node_times(graph, samples[b], layer_repeats) for b in (small, large)}
        slopes = np.maximum(times[large] - times[small], 0) / (large - small)
        fit = _fit_stages(model, samples, slopes, stage_repeats)
        loss = _loss_cost(model, samples, stage_repeats)
        fused = _fused_cost(model, samples, stage_repeats)
        read_out = median_seconds(_read_metrics, stage_repeats, model)
    f, b, o = fit["forward"], fit["backward"], fit["optimizer"]
    layers, seen = [], set()
    for node in graph.nodes:  # a layer's parameters count at its first call
        owned = node.is_layer and id(node.operation) not in seen
        seen.add(id(node.operation))
        variables = list(node.operation.trainable_variables) if owned else []
        slope = slopes[node.position]
        layers.append(
            LayerCost(
                node.name,
                Affine(f[1], float(f[2] * slope)),
                Affine(b[1], float(b[2] * slope)),
                sum(variable_bytes(v) for v in variables),
                len(variables),
            )
        )
    sizes = tuple(sorted((small, large) if fit_batch_sizes is None else fit_batch_sizes))
    single = fit_step(model, sizes, input_shape=input_shape) if sizes else None
    cpu, wall = time.process_time() - started[0], time.perf_counter() - started[1]
    measured = {
        **timing_facts(small, large),
        # about 1 on an otherwise idle core; lower: other jobs shared it, timings inflated
        "cpu_share": cpu / wall,
        # the stage fit's coefficients (see _fit_stages), the last its relative residual
        "stage_fit": fit,
    }
    engine = EngineCosts(f[0], b[0], loss, b[3], o[0], o[1], o[2], read_out)
    cuts = [float(c) for c in cost.cut_bytes_per_sample(graph)]
    return ModelCosts(model.name, layers, cuts, engine, single, measured, fused)


def _fit_stages(model, samples, slopes, repeats) -> dict:
    """Stage steps on the whole model and on the stages of 2- and 4-way splits (by layer
    count), at (small batch, 4 micro-batches), (small, 1) and (large, 1), fitted by
    non-negative least squares:

        forward   = M (per call + per layer x layers + scale x batch x sum of per-sample costs)
        backward  = the same with its own coefficients + (M - 1) x per byte x parameter bytes
        optimizer = fixed + per variable x variables + per byte x parameter bytes

    Returns {"forward"|"backward"|"optimizer": (coefficients..., relative residual)}.
    """
    whole = (
        0,
        len(slopes),
        lambda xs: model(model_input(model, xs), training=True),
        model.trainable_variables,
        list,
    )
    stages = [whole]
    for parts in (p for p in SPLITS if p <= len(slopes)):
        plan, a = partition(model, parts, balance="layers"), 0
        for k, stage in enumerate(plan.stages):
            call = lambda xs, s=stage: s.forward(xs, training=True)  # noqa: E731
            before = lambda xs, earlier=plan.stages[:k]: _run_stages(earlier, xs)  # noqa: E731
            stages.append((a, a + len(stage.nodes), call, stage.model.trainable_variables, before))
            a += len(stage.nodes)
    small, large = sorted(samples)
    rows = {"forward": [], "backward": [], "optimizer": []}  # (factors, seconds)
    for a, b, call, variables, before in stages:
        nbytes, work = sum(variable_bytes(v) for v in variables), slopes[a:b].sum()
        for batch, micro in ((small, 4), (small, 1), (large, 1)):
            f, bwd, opt = _stage_step(
                model, call, variables, before(samples[batch]), micro, repeats
            )
            per_call = [micro, micro * (b - a), micro * batch * work]
            rows["forward"].append((per_call, f))
            rows["backward"].append(([*per_call, (micro - 1) * nbytes], bwd))
            if variables:
                rows["optimizer"].append(([1.0, len(variables), nbytes], opt))
    fits = {}
    for part, data in rows.items():
        matrix, target = np.array([r for r, _ in data]), np.array([t for _, t in data])
        coefficients = _nonnegative_least_squares(matrix, target)
        residual = np.abs(matrix @ coefficients - target).sum() / max(target.sum(), 1e-12)
        fits[part] = [*(float(c) for c in coefficients), float(residual)]
    return fits


def _run_stages(stages, inputs):
    """The inputs of the stage after `stages`, from the model's."""
    for stage in stages:
        inputs = stage.forward(inputs, training=True)
    return inputs


def _stage_step(model, call, variables, x, microbatches, repeats) -> tuple[float, float, float]:
    """Median seconds of the forwards, the backwards (output gradients given, as a middle
    stage gets them) and the optimizer update of one step of one stage."""
    forward_fn = traced(call)
    inputs = [t for t in tf.nest.flatten(x) if t.dtype.is_floating]
    optimizer = keras.optimizers.deserialize(keras.optimizers.serialize(model.optimizer))
    copies = [keras.Variable(v.numpy(), dtype=v.dtype) for v in variables]
    if copies:
        optimizer.build(copies)
    apply = traced(lambda grads: optimizer.apply(grads, copies))
    sources = [*variables, *inputs]
    timings = []
    for i in range(repeats + 1):
        forward = backward = 0.0
        total = None
        for _ in range(microbatches):
            start = time.perf_counter()
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                outputs = [y for y in tf.nest.flatten(forward_fn(x)) if y.dtype.is_floating]
            forward += time.perf_counter() - start
            start = time.perf_counter()
            seeds = [tf.ones_like(y) for y in outputs]
            unused = tf.UnconnectedGradients.ZERO  # a variable the stage does not use: zeros
            grads = tape.gradient(outputs, sources, seeds, unused)[: len(variables)]
            total = grads if total is None else list(map(_summed, total, grads))
            backward += time.perf_counter() - start
        start = time.perf_counter()
        if copies:
            apply(total)  # compiled, as the engine's optimizer step
            copies[0].numpy()
        update = time.perf_counter() - start
        if i:  # the first round traces and builds the optimizer
            timings.append((forward, backward, update))
    return tuple(statistics.median(t[j] for t in timings) for j in range(3))


def _nonnegative_least_squares(matrix, target) -> np.ndarray:
    """Least squares with every coefficient >= 0, by trying each set of free coefficients."""
    best, best_error = np.zeros(matrix.shape[1]), float(np.sum(target**2))
    for size in range(1, matrix.shape[1] + 1):
        for free in itertools.combinations(range(matrix.shape[1]), size):
            solution = np.zeros(matrix.shape[1])
            solution[list(free)] = np.linalg.lstsq(matrix[:, free], target, rcond=None)[0]
            error = float(np.sum((matrix @ solution - target) ** 2))
            if (solution >= 0).all() and error < best_error:
                best, best_error = solution, error
    return best


def _loss_cost(model, samples, repeats) -> Affine:
    """The last stage's extra forward work: the compiled loss and metric update."""

    @traced
    def loss(y, y_pred):
        _update_metrics(model, y, y_pred)
        return _keras.compiled_loss(model)(y, y_pred, None)

    outputs = {b: model(model_input(model, x), training=False) for b, x in samples.items()}
    return _affine(loss, {b: (zero_targets(model, y), y) for b, y in outputs.items()}, repeats)


def _fused_cost(model, samples, repeats) -> Affine:
    """Seconds of one micro-batch of the unpartitioned step: forward, loss, metrics and
    gradients concatenated flat in one compiled call (weights not updated), as the engine
    runs data parallelism."""
    variables = list(model.trainable_variables)

    @traced
    def step(x, y):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = _keras.compiled_loss(model)(y, y_pred, None)
        _update_metrics(model, y, y_pred)
        grads = [tf.reshape(g, [-1]) for g in tape.gradient(loss, variables) if g is not None]
        return loss, tf.concat(grads, 0) if grads else loss

    inputs = {b: model_input(model, x) for b, x in samples.items()}
    targets = {b: zero_targets(model, model(x, training=False)) for b, x in inputs.items()}
    line = _affine(step, {b: (x, targets[b]) for b, x in inputs.items()}, repeats)
    for metric in model.metrics:
        metric.reset_state()
    return line


def _affine(function, arguments: dict, repeats: int) -> Affine:
    """The line through the median seconds of `function(*arguments[batch])` at two batches."""
    (small, a), (large, b) = sorted(
        (k, median_seconds(function, repeats, *v)) for k, v in arguments.items()
    )
    return Affine.through(small, a, large, b)


def fit_step(model, batch_sizes, steps: int = 8, input_shape=None) -> Affine:
    """Seconds of one plain `model.fit` step (from one step's start to the next, so Keras's
    work between steps counts) on a copy of the model, at two batch sizes (median of the
    steps): the one-rank baseline, `ModelCosts.single_process`."""
    clone = keras.models.clone_model(model)
    clone.compile_from_config(model.get_compile_config())
    graph, typical, starts = build_graph(clone), {}, []  # each step's start; None: an epoch's
    timer = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: starts.append(None),
        on_train_batch_begin=lambda step, logs: starts.append(time.perf_counter()),
    )
    for batch in batch_sizes:
        inputs = profile.make_sample(graph, input_shape=input_shape, batch_size=batch * steps)
        x = model_input(clone, [np.asarray(t) for t in inputs])
        y = zero_targets(clone, clone(x, training=False), as_numpy=True)
        clone.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # traces
        starts.clear()
        clone.fit(x, y, batch_size=batch, epochs=2, verbose=0, callbacks=[timer])
        typical[batch] = statistics.median(
            b - a for a, b in itertools.pairwise(starts) if a is not None and b is not None
        )
    (small, a), (large, b) = sorted(typical.items())
    return Affine.through(small, a, large, b)


def _update_metrics(model, y, y_pred) -> None:
    metrics = _keras.compiled_metrics(model)
    if metrics is not None:
        metrics.update_state(y, y_pred, None)


def _read_metrics(model) -> list[float]:
    """The logs' read-out on the last stage: every metric result as a Python float."""
    return [float(v) for v in keras.tree.flatten(model.get_metrics_result())]


def zero_targets(model, y_pred, as_numpy=False):
    """Targets (zeros: only the costs matter) that `model`'s loss takes for `y_pred`: class
    indices for an output of classes (a sequence's: one per position) if the loss takes them
    (sparse losses), else the output's shape."""
    outputs = tf.nest.flatten(y_pred)
    shaped = [np.zeros(out.shape, "float32") for out in outputs]
    indices = [
        np.zeros(out.shape[:-1], "int64") if len(out.shape) >= 2 and out.shape[-1] > 1 else like
        for out, like in zip(outputs, shaped, strict=True)
    ]
    for made in (indices, shaped):
        made = made if as_numpy else [tf.convert_to_tensor(value) for value in made]
        made = made[0] if len(made) == 1 else made
        with contextlib.suppress(ValueError, tf.errors.InvalidArgumentError):  # the other kind
            _keras.compiled_loss(model)(made, y_pred, None)
            return made
    return made


def _summed(a, b):
    """Two micro-batches' gradients of one variable added, as the engine adds them: an
    embedding's row slices (`tf.IndexedSlices`) concatenated, not densified."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape
        )
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def model_input(model, inputs):
    """Flat inputs (in `model.inputs`' order) in the structure `model` takes: one tensor, a
    list, or a dict by input name (keras_hub's models)."""
    return keras.tree.pack_sequence_as(model.input, list(inputs))


def timing_facts(small: int, large: int) -> dict:
    """Where and how costs were timed: this host, its cores, TensorFlow, its threads, the two
    batch sizes and the date (`ModelCosts.measured`)."""
    return {
        "host": platform.node(),
        "cores": os.cpu_count(),
        "tensorflow": tf.__version__,
        "intra_op_threads": os.environ.get("TF_NUM_INTRAOP_THREADS", "default"),
        "batch_sizes": [small, large],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def median_seconds(function, repeats, *args) -> float:
    """Median seconds of `repeats` calls of `function(*args)` after a warm-up (tracing) one."""
    function(*args)
    return statistics.median(timeit.repeat(lambda: function(*args), number=1, repeat=repeats))


def variable_bytes(variable) -> int:
    """Bytes of `variable` (bfloat16 counted as the float16 numpy has)."""
    dtype = keras.backend.standardize_dtype(variable.dtype).replace("bfloat16", "float16")
    return math.prod(variable.shape) * np.dtype(dtype).itemsize
