"""Figure 7, memory: per-rank parameter + optimizer bytes and peak RSS for 1, 2 and 4 partitions.

Run: .venv/bin/python benchmarks/memory_partitions.py [--partitions 1 2 4] [--rounds 2]
     (starts `mpirun` itself; 4 ranks oversubscribe 2 cores, which does not change memory)

A parameter-heavy MLP (8 x 2048, Adam) trained a few steps: by `model.fit` in one process for
1 partition, by `hf.fit` with `strategy="model"` on P ranks. Each rank reports the bytes of its
stage's variables, of their optimizer state, of every weight in the user's model object (each
rank holds it), its resident memory before training and its peak (VmHWM); rows show the largest
rank. With P >= 2 the fit runs again with per-variable gradients (`flat_gradients=False`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402

FIGURE = "memory"
TITLE = "(7) Memory per rank: parameters, optimizer state and peak RSS for 1, 2, 4 partitions"
MIB = 2**20
ROWS = [("params", "stage parameters"), ("optimizer", "optimizer state (Adam)"),
        ("model_weights", "whole model's weights held by the rank"),
        ("rss_before", "RSS before training"), ("peak", "peak RSS")]  # fmt: skip


def worker(args) -> None:
    import keras

    import hyparflow as hf
    from benchmarks.harness.memory import peak_rss_bytes, rss_bytes, variable_bytes
    from benchmarks.models import mlp, synthetic_data

    keras.config.disable_interactive_logging()
    model = mlp(args.width, args.depth, optimizer="adam")
    x, y = synthetic_data(model, args.batch_size * args.steps)
    before = rss_bytes()
    fit = dict(batch_size=args.batch_size, epochs=1, verbose=0)
    if args.partitions == [1]:  # the worker gets one count
        model.fit(x, y, **fit)
        stage_variables = model.trainable_variables
    else:
        flat = not args.list_gradients
        strategy = hf.Strategy("model", microbatches=args.microbatches, schedule="1f1b",
                               flat_gradients=flat, tune_process=True)  # fmt: skip
        hf.fit(model, x, y, strategy=strategy, **fit)
        stage_variables = model._hyparflow_trainer[1].variables  # this rank's stage
    write_result(args.worker_out, hf.rank(), {
        "params": variable_bytes(stage_variables),
        "optimizer": variable_bytes(model.optimizer.variables),
        "model_weights": variable_bytes(model.weights),
        "rss_before": before, "peak": peak_rss_bytes(),
    })  # fmt: skip


def run(args) -> list[dict]:
    rows: dict = {}
    variants = [(p, False) for p in args.partitions]
    variants += [(p, True) for p in args.partitions if p > 1]
    for round_ in range(args.rounds):
        order = variants if round_ % 2 == 0 else variants[::-1]
        for partitions, list_gradients in order:
            shape = cli.flags(args, "width", "depth", "batch_size", "steps", "microbatches")
            worker_args = ["--partitions", partitions, *shape]
            worker_args += ["--list-gradients"] if list_gradients else []
            ranks = run_worker(__file__, worker_args, np=partitions)
            largest = max(ranks, key=lambda r: r["params"] + r["optimizer"])
            row = rows.setdefault((partitions, list_gradients), {})
            for key, value in largest.items():
                row.setdefault(key, []).append(value / MIB)
    records = []
    for (partitions, list_gradients), values in rows.items():
        where = f"{partitions} partition(s), largest rank"
        # with per-variable gradients only the peak differs
        for key, name in [("peak", "peak RSS, flat_gradients=False")] if list_gradients else ROWS:
            records.append(measurement(FIGURE, f"{name}, {where}", values[key], "MiB", series=name,
                                       x=partitions, x_label="partitions"))  # fmt: skip
    return records


def arguments(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--partitions", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--list-gradients", action="store_true", help="worker: flat_gradients=False")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.width, args.partitions = 1, 256, [1, 2]
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
