"""Measure a Keras model's `ModelCosts` on this machine (TensorFlow; one process, no MPI).

1. Per layer: the forward, and the forward plus backward, of each layer call compiled alone
   and timed on random inputs at two batch sizes (as the partitioner's `balance="time"` does;
   fastest of several timings, since interference only adds time). Their growth with the
   batch is the layer's per-sample cost. A layer timed alone carries call overheads it does
   not have inside a stage, so these numbers only say how the work is *distributed*.
2. Per stage, as the engine runs a step: hyparflow's `StageRunner` over several micro-batches
   (forward under a tape, backward, gradients summed), then the compiled optimizer update, on
   the whole model and on the stages of 2- and 4-way splits, at both batch sizes. Medians of
   several repetitions, fitted by non-negative least squares (see `_fit_stages`): a call costs
   a fixed part, a part per layer, and the layers' per-sample costs times one scale, which
   turns step 1 into what the engine pays; summing a micro-batch's gradients costs per byte;
   the optimizer costs a fixed part, per variable and per byte.
3. The last stage's loss and metrics, the whole model's fused step (`FusedRunner`: forward,
   loss, metrics and gradients in one compiled call, gradients flattened, as data parallelism
   runs it), the training loop's work between steps (the logs' metric read-out of replica
   sums, `ReplicaMetrics`), and one plain `model.fit` step (the one-rank baseline, from one
   step's start to the next) on a copy of the model.

Run it with the thread settings the training ranks will use (`TF_NUM_INTRAOP_THREADS`).
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import statistics
import time

import numpy as np

from hyparflow.simulate.costs import Affine, EngineCosts, LayerCost, ModelCosts

DEFAULT_BATCH_SIZES = (16, 64)
SPLITS = (2, 4)  # stage variants the engine costs are fitted on (besides the whole model)


def measure_model(
    model,
    batch_sizes: tuple[int, int] = DEFAULT_BATCH_SIZES,
    input_shape=None,
    repeats: int = 7,
    fit_steps: int = 8,
    stage_repeats: int = 15,
    fit_batch_sizes: tuple[int, int] | None = None,
) -> ModelCosts:
    """Per-layer and engine costs of a compiled functional or Sequential Keras `model`.

    The model's weights are restored afterwards; the fit baseline trains a copy. `repeats`
    timings per layer (the fastest counts), `stage_repeats` per stage step (the median
    counts), `fit_steps` steps of the fit baseline per batch size, at `fit_batch_sizes`
    (default `batch_sizes`; give the sizes one rank will train at).

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
    if small == large:
        raise ValueError(f"batch_sizes needs two different sizes, got {batch_sizes}")
    started = (time.process_time(), time.perf_counter())
    graph = build_graph(model)
    samples = {b: profile.make_sample(graph, input_shape=input_shape, batch_size=b)
               for b in (small, large)}  # fmt: skip
    forward, backward = {}, {}
    with profile.preserved_state(model):
        for b in (small, large):
            forward[b] = _forward_times(graph, samples[b], repeats)
            backward[b] = np.maximum(profile.node_times(graph, samples[b], repeats) - forward[b], 0)
        slopes = {
            "forward": np.maximum(forward[large] - forward[small], 0) / (large - small),
            "backward": np.maximum(backward[large] - backward[small], 0) / (large - small),
        }
        fit = _fit_stages(model, samples, slopes, stage_repeats)
        loss = _loss_cost(model, samples, stage_repeats)
        fused = _fused_cost(model, samples, stage_repeats)
        between_steps = _logs_cost(model, stage_repeats)
    forward_fit, backward_fit, optimizer_fit = fit["forward"], fit["backward"], fit["optimizer"]
    layers, seen = [], set()
    for node in graph.nodes:
        variables = []
        if node.is_layer and id(node.operation) not in seen:
            seen.add(id(node.operation))
            variables = list(node.operation.trainable_variables)
        i = node.position
        layers.append(
            LayerCost(
                name=node.name,
                forward=Affine(forward_fit[1], forward_fit[2] * slopes["forward"][i]),
                backward=Affine(backward_fit[1], backward_fit[2] * slopes["backward"][i]),
                param_bytes=sum(_nbytes(v) for v in variables),
                variables=len(variables),
            )
        )  # fmt: skip
    engine = EngineCosts(
        forward_call=forward_fit[0],
        backward_call=backward_fit[0],
        loss=loss,
        accumulate_per_byte=backward_fit[3],
        optimizer_fixed=optimizer_fit[0],
        optimizer_per_variable=optimizer_fit[1],
        optimizer_per_byte=optimizer_fit[2],
        step_fixed=between_steps,
    )
    return ModelCosts(
        name=model.name,
        layers=layers,
        cut_bytes=[float(b) for b in cost.cut_bytes_per_sample(graph)],
        engine=engine,
        fused=fused,
        single_process=fit_step(
            model, tuple(sorted(fit_batch_sizes or (small, large))), fit_steps, input_shape
        ),
        measured={
            "host": platform.node(),
            "processor": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "intra_op_threads": os.environ.get("TF_NUM_INTRAOP_THREADS", "default"),
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "batch_sizes": [small, large],
            # CPU this process got over the wall time (about 1 on an otherwise idle core):
            # lower means other jobs shared the core and the timings are inflated
            "cpu_share": (time.process_time() - started[0]) / (time.perf_counter() - started[1]),
            # coefficients of the stage fit (see _fit_stages), the last is the relative residual
            "stage_fit": {part: list(coefficients) for part, coefficients in fit.items()},
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    )


def _forward_times(graph, inputs, repeats) -> np.ndarray:
    """Seconds of each node's forward alone (training mode), the empty call subtracted."""
    import tensorflow as tf

    from hyparflow.partitioner import profile

    empty = tf.function(lambda xs: [tf.identity(x) for x in xs])
    overhead = profile._best_time(empty, inputs, repeats)
    values = dict(zip(graph.inputs, inputs))
    times = np.zeros(len(graph.nodes))
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


def _fit_stages(model, samples, slopes, repeats) -> dict:
    """Run the engine's StageRunner the way a step does, on the whole model and on the
    stages of 2- and 4-way splits (balanced by layer count): `M` micro-batches, each forward
    then backward (gradients summed over micro-batches), then the optimizer on the stage's
    variables, for (small batch, 4 micro-batches), (small, 1) and (large, 1). Fit, by
    non-negative least squares over all of them,

        forward   = M (per call + per layer x layers + scale x batch x sum of per-sample costs)
        backward  = the same with its own coefficients + (M - 1) x per byte x parameter bytes
        optimizer = fixed + per variable x variables + per byte x parameter bytes

    Returns {"forward"|"backward"|"optimizer": (coefficients..., relative residual)}.
    """
    from hyparflow.partitioner import partition

    n = len(slopes["forward"])
    variants = [(0, n, None, 0)]
    for parts in SPLITS:
        if parts <= n:
            plan = partition(model, parts, balance="layers")
            bounds = np.cumsum([0] + [len(stage.nodes) for stage in plan.stages])
            variants += [
                (int(a), int(b), plan, k) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))
            ]
    small, large = sorted(samples)
    rows = {"forward": [], "backward": [], "optimizer": []}
    seconds = {"forward": [], "backward": [], "optimizer": []}
    for a, b, plan, k in variants:
        call, variables, before = _stage(model, plan, k)
        nbytes = sum(_nbytes(v) for v in variables)
        for batch, micro in ((small, 4), (small, 1), (large, 1)):
            x = before(samples[batch])
            f, bwd, opt = _stage_step(model, call, variables, x, micro, repeats)
            rows["forward"].append(
                [micro, micro * (b - a), micro * batch * slopes["forward"][a:b].sum()]
            )
            rows["backward"].append(
                [micro, micro * (b - a), micro * batch * slopes["backward"][a:b].sum(),
                 (micro - 1) * nbytes]
            )  # fmt: skip
            seconds["forward"].append(f)
            seconds["backward"].append(bwd)
            if variables:
                rows["optimizer"].append([1.0, len(variables), nbytes])
                seconds["optimizer"].append(opt)
    fits = {}
    for part in rows:
        matrix, target = np.array(rows[part]), np.array(seconds[part])
        coefficients = _nonnegative_least_squares(matrix, target)
        residual = np.abs(matrix @ coefficients - target).sum() / max(target.sum(), 1e-12)
        fits[part] = (*(float(c) for c in coefficients), float(residual))
    return fits


def _stage(model, plan, k):
    """A stage's call, its variables, and how to make its inputs from the model's."""
    if plan is None:
        call = lambda xs, training: model(xs, training=training)  # noqa: E731
        return call, model.trainable_variables, lambda inputs: _unlisted(inputs)
    stage = plan.stages[k]

    def before(inputs):
        for earlier in plan.stages[:k]:
            inputs = earlier.forward(inputs, training=True)
        return inputs

    call = lambda xs, training: stage.forward(xs, training=training)  # noqa: E731
    return call, stage.model.trainable_variables, before


def _stage_step(model, call, variables, x, microbatches, repeats) -> tuple[float, float, float]:
    """Median seconds of the forwards, the backwards and the optimizer update of one step of
    one stage over `microbatches` micro-batches (as a middle stage: output gradients given)."""
    import keras
    import tensorflow as tf

    from hyparflow.engine.flat import FlatLayout
    from hyparflow.engine.stage import StageRunner

    layout = FlatLayout(variables)  # gradients as the engine keeps them
    runner = StageRunner(
        call,
        variables,
        layout=layout if layout.usable else None,
        flat_backward=layout.flat_backward_pays,  # as a stage of these variables would
    )
    optimizer = keras.optimizers.deserialize(keras.optimizers.serialize(model.optimizer))
    copies = [keras.Variable(v.numpy(), dtype=v.dtype) for v in variables]
    if copies:
        optimizer.build(copies)
    apply = tf.function(lambda grads: optimizer.apply(grads, copies))
    seeds = None
    timings = []
    for i in range(repeats + 1):
        forward = backward = 0.0
        for k in range(microbatches):
            start = time.perf_counter()
            outputs = runner.forward(k, x)
            forward += time.perf_counter() - start
            if seeds is None:
                seeds = [tf.ones_like(t) for t in tf.nest.flatten(outputs)]
            start = time.perf_counter()
            runner.backward(k, seeds)
            backward += time.perf_counter() - start
        grads = [tf.convert_to_tensor(g) for g in runner.take_gradients()]  # views if flat
        start = time.perf_counter()
        if copies:
            apply(grads)  # compiled, as the engine's optimizer step
            copies[0].numpy()
        update = time.perf_counter() - start
        if i:  # the first round traces and builds the optimizer
            timings.append((forward, backward, update))
    return tuple(statistics.median(t[j] for t in timings) for j in range(3))


def _nonnegative_least_squares(matrix, target) -> np.ndarray:
    """Least squares with every coefficient >= 0, by trying each set of free coefficients
    (three unknowns: eight sets)."""
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
    """The last stage's extra forward work: the loss and the metric update."""
    import tensorflow as tf

    from hyparflow.engine.stage import StageRunner

    variables = list(model.trainable_variables)
    call = lambda xs, training: model(xs, training=training)  # noqa: E731
    middle = StageRunner(call, variables)
    last = StageRunner(call, variables, loss=model._compile_loss)
    metrics = tf.function(_metric_update(model))
    loss = {}
    for batch, inputs in samples.items():
        x = _unlisted(inputs)
        y = _targets(model(x, training=False))

        def with_loss(x=x, y=y):
            y_pred, value = last.forward(0, x, (y, None), 1.0)
            metrics(y, y_pred)
            float(value)
            last._pending.clear()

        def without(x=x):
            tf.nest.flatten(middle.forward(0, x))[0].numpy()
            middle._pending.clear()

        with_ = statistics.median(_repeat(with_loss, repeats))
        loss[batch] = max(0.0, with_ - statistics.median(_repeat(without, repeats)))
    small, large = sorted(loss)
    return Affine.through(small, loss[small], large, loss[large])


def _fused_cost(model, samples, repeats) -> Affine:
    """Seconds of one micro-batch of the unpartitioned engine step: forward, loss, metrics and
    flat gradients in one compiled call (`engine/fused.py`)."""
    seconds = {}
    for batch, inputs in samples.items():
        seconds[batch] = statistics.median(_repeat(fused_step(model, inputs), repeats))
    for metric in model.metrics:
        metric.reset_state()
    small, large = sorted(seconds)
    return Affine.through(small, seconds[small], large, seconds[large])


def fused_step(model, inputs):
    """A callable running one unpartitioned engine step of the compiled `model` on `inputs`
    (forward, loss, metrics, flat gradients; the weights are not updated): what
    `_fused_cost` times, and a steady probe of the machine's speed.

    Example:
        >>> step = fused_step(model, profile.make_sample(build_graph(model), batch_size=64))
        >>> step()   # the first call traces
    """
    from hyparflow.engine.flat import FlatLayout
    from hyparflow.engine.fused import FusedRunner

    variables = list(model.trainable_variables)
    layout = FlatLayout(variables)
    update = _metric_update(model)
    runner = FusedRunner(
        lambda xs, training: model(xs, training=training),
        variables,
        loss=model._compile_loss,
        metrics=lambda y, y_pred, sample_weight: update(y, y_pred),
        layout=layout if layout.usable else None,
    )
    x = _unlisted(inputs)
    y = _targets(model(x, training=False))

    def step():
        _, value = runner.forward(0, x, (y, None), 1.0)
        runner.backward(0)
        runner.take_flat_gradients() if runner.layout else runner.take_gradients()
        float(value)

    return step


def _logs_cost(model, repeats) -> float:
    """Seconds the training loop spends on the logs after a step: the last stage reads its
    metric states out, takes the replicas' sums in and computes the results (the
    `Allreduce` between is the network's)."""
    from hyparflow.engine.metrics import ReplicaMetrics, to_floats

    if not model.metrics_variables:
        results = model.get_metrics_result
        return statistics.median(_repeat(lambda: to_floats(results()), repeats))
    metrics = ReplicaMetrics(model, comm=None)
    return statistics.median(_repeat(lambda: metrics.results_with(metrics.local_states()), repeats))


def fit_step(model, batch_sizes, steps: int = 8, input_shape=None) -> Affine:
    """Seconds of one plain `model.fit` step (from one step's start to the next, so Keras's
    work between steps counts) on a copy of the model, at two batch sizes (median of the
    steps): the one-rank baseline, `ModelCosts.single_process`.

    Example:
        >>> costs.single_process = fit_step(model, (128, 256))
    """
    import keras

    from hyparflow.partitioner import profile
    from hyparflow.partitioner.graph import build_graph

    clone = keras.models.clone_model(model)
    clone.compile_from_config(model.get_compile_config())
    graph = build_graph(clone)
    timer = _step_timer()
    typical = {}
    for batch in batch_sizes:
        inputs = profile.make_sample(graph, input_shape=input_shape, batch_size=batch * steps)
        x = [np.asarray(t) for t in inputs]
        x = x[0] if len(x) == 1 else x
        y = _targets(clone(x, training=False), as_numpy=True)
        clone.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # traces
        timer.times = []
        clone.fit(x, y, batch_size=batch, epochs=2, verbose=0, callbacks=[timer])
        typical[batch] = statistics.median(timer.times)
    small, large = batch_sizes
    return Affine.through(small, typical[small], large, typical[large])


def _step_timer():
    """A Keras callback recording the seconds from each batch's start to the next's (within
    an epoch)."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self._start = [], None

        def on_epoch_begin(self, epoch, logs=None):
            self._start = None

        def on_train_batch_begin(self, batch, logs=None):
            now = time.perf_counter()
            if self._start is not None:
                self.times.append(now - self._start)
            self._start = now

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

    made = []
    for out in tf.nest.flatten(y_pred):
        if len(out.shape) == 2 and out.shape[-1] > 1:
            value = np.zeros(out.shape[0], dtype="int64")
        else:
            value = np.zeros(out.shape, dtype="float32")
        made.append(value if as_numpy else tf.convert_to_tensor(value))
    return made[0] if len(made) == 1 else made


def _unlisted(inputs):
    return inputs[0] if isinstance(inputs, list) and len(inputs) == 1 else inputs


def _repeat(function, repeats):
    """Seconds of `repeats` calls after a warm-up (tracing) call."""
    function()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return seconds


def _nbytes(variable) -> int:
    name = getattr(variable.dtype, "name", str(variable.dtype))
    return math.prod(variable.shape) * np.dtype({"bfloat16": "float16"}.get(name, name)).itemsize
