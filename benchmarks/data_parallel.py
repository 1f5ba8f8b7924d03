"""Figure 4, data parallel end to end: hyparflow vs a Horovod training loop vs one process.

Run: .venv/bin/python benchmarks/data_parallel.py [--rounds 3] [--models mlp,resnet20]
     (starts `mpirun` itself, in .venv-compat, which has Horovod; else in .venv without it)

Same model, global batch and data; samples/s over the epochs after the first. Ways, each in
its own launch, order rotated each round:

- hyparflow: `hf.fit` with `strategy="data"` on N ranks;
- Horovod: the loop a Keras 3 user writes (docs/horovod.md): a `tf.function` step computing
  the shard's gradients, `hvd.grouped_allreduce(op=hvd.Average)`, the optimizer's `apply`;
- Keras: `model.fit` in one process, with one compute thread and with one per core.

Target: hyparflow / Horovod samples/s >= 1 at equal ranks (paired per round).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import has_horovod, run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement, target  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402
from benchmarks.models import cifar_resnet, mlp  # noqa: E402

FIGURE = "data_parallel"
TITLE = "(4) Data parallel end to end: hyparflow vs Horovod loop vs single-process Keras"
MODELS = {  # name: (model builder, global batch size)
    "mlp": (lambda: mlp(1024, 3, inputs=784), 256),
    "resnet20": (lambda: cifar_resnet(20), 64),
}


def horovod_epochs(model, x, y, batch: int, epochs: int, steps: int) -> list[float]:
    """Train with Horovod's allreduce in a compiled step; seconds of each epoch."""
    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    hvd.init()
    loss_fn = keras.losses.get(model.loss)  # per-sample losses; the step takes their mean
    optimizer = model.optimizer
    variables = model.trainable_variables
    optimizer.build(variables)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            predictions = model(xb, training=True)
            loss = tf.reduce_mean(loss_fn(yb, predictions))
        grads = tape.gradient(loss, variables)
        grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply(grads, variables)
        return loss

    shard = batch // hvd.size()
    seconds = []
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(x))
        start = time.perf_counter()
        for s in range(steps):
            mine = order[s * batch + hvd.rank() * shard : s * batch + (hvd.rank() + 1) * shard]
            step(tf.convert_to_tensor(x[mine]), tf.convert_to_tensor(y[mine]))
        seconds.append(time.perf_counter() - start)
    return seconds


def worker(args) -> None:
    import hyparflow as hf

    build, batch = MODELS[args.model]
    train_ways(args, build(), batch, hf.Strategy("data", tune_process=True))


def train_ways(args, model, batch: int, strategy) -> None:
    """Train `model` `args.epochs` epochs the `args.way` way (hyparflow: `hf.fit` with
    `strategy`); rank 0 writes the samples/s of each epoch after the first."""
    import keras

    import hyparflow as hf
    from benchmarks.harness.timing import epoch_timer
    from benchmarks.models import synthetic_data

    keras.config.disable_interactive_logging()
    x, y = synthetic_data(model, batch * args.steps)
    if args.way == "horovod":
        seconds = horovod_epochs(model, x, y, batch, args.epochs, args.steps)
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    else:
        timer = epoch_timer()
        fit = dict(batch_size=batch, epochs=args.epochs, verbose=0, callbacks=[timer])
        if args.way == "hyparflow":
            hf.fit(model, x, y, strategy=strategy, **fit)
        else:
            model.fit(x, y, **fit)
        seconds, rank = timer.seconds, hf.rank()
    if rank == 0:
        write_result(args.worker_out, 0, [batch * args.steps / s for s in seconds[1:]])


def _launch(args, model: str, way: str, ranks: int, threads: int) -> list[float]:
    worker_args = ["--model", model, "--way", way, "--steps", args.steps, "--epochs", args.epochs]
    venv = "compat" if has_horovod() else "main"
    return run_worker(__file__, worker_args, np=ranks, venv=venv, threads=threads)[0]


def _label(way: str, ranks: int, threads: int, cores: int) -> str:
    if way == "keras":
        return f"Keras model.fit, 1 process, {threads} thread(s)"
    note = " (oversubscribed)" if ranks > cores else ""
    return f"{'hyparflow hf.fit' if way == 'hyparflow' else 'Horovod loop'}, {ranks} ranks{note}"


def run(args) -> list[dict]:
    cores = os.cpu_count() or 1
    ways = [("hyparflow", ranks, 1) for ranks in args.ranks]
    if has_horovod():
        ways += [("horovod", ranks, 1) for ranks in args.ranks]
    ways += [("keras", 1, threads) for threads in sorted({1, cores})]
    records = []
    for model in args.models.split(","):
        batch = MODELS[model][1]
        rates = {way: [] for way in ways}
        for round_ in range(args.rounds):
            shift = round_ % len(ways)  # every way goes first in some round
            for way in ways[shift:] + ways[:shift]:
                rates[way].append(statistics.median(_launch(args, model, *way)))
        for way, values in rates.items():
            name = f"{_label(*way, cores)}, {model}"
            records.append(measurement(FIGURE, name, values, "samples/s", batch=batch))
        for ranks in args.ranks if has_horovod() else ():
            ratios = paired_ratios(rates["hyparflow", ranks, 1], rates["horovod", ranks, 1])
            over = " (oversubscribed)" if ranks > cores else ""
            name = f"hyparflow / Horovod samples/s, {model}, {ranks} ranks{over}"
            records.append(target(FIGURE, name, ratios, ">= 1.0"))
    return records


def arguments(argv=None):
    p = cli.parser(__doc__, rounds=3, steps=20, epochs=4)
    p.add_argument("--models", default="mlp,resnet20")
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--model", help="worker: which model")
    p.add_argument("--way", choices=["hyparflow", "horovod", "keras"], help="worker: how")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.rounds, args.steps, args.epochs = "mlp", 1, 3, 2
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
