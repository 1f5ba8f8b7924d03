"""Figure 5, pipeline: bubble vs formula, GPipe, 1F1B, ZB-H1, interleaved; memory per rank.

Run: .venv/bin/python benchmarks/pipeline_bubble.py [--rounds 3] [--microbatches 1 2 4 8 16]

Bubble: a 2-stage MLP trained by `hf.fit` with the `ScalingProfiler`, each schedule and m in
one launch per round (order reversed every round), micro-batches of `--microbatch-rows` rows at
every m (the batch grows with m, as a pipeline's does: shrinking micro-batches would measure the
per-call overhead, not the schedule). Measured: `1 - compute / makespan` over steady steps;
formula: (p-1)/(m+p-1), (p-1)/(vm+p-1) interleaved, ZB-H1's idle fraction at the measured F,
B, W times; simulated: the schedule at the measured stage times (what imbalance is left). The
stages are alike by construction (see `LAYERS`), 1F1B's two stages and interleaved's (v = 2)
four chunks alike. Targets: each within 5 points of its formula; ZB-H1's and interleaved's
bubble below 1F1B's.

Memory: GPipe, 1F1B, ZB-H1 in launches of their own, a bigger batch, m = 8: each rank's peak RSS."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement, target  # noqa: E402

FIGURE = "pipeline"
TITLE = "(5) Pipeline: bubble vs formula (GPipe, 1F1B, ZB-H1, interleaved), memory per rank"
SCHEDULES = ("gpipe", "1f1b", "zero_bubble")  # also in the memory runs
LABELS = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "zero_bubble": "ZB-H1",
    "interleaved": "Interleaved v=2",
}
PAIRS = [("zero_bubble", "1f1b"), ("interleaved", "1f1b")]  # each below the second
# Stages alike by construction: a first layer on NARROW_INPUTS features costs almost nothing, so
# every stage (or chunk) computes as many width x width layers, forward, input and weight
# gradients (stage 0's first full layer still needs its input gradient, for the narrow layer's
# weights); the last stage's extra head and loss are a 10-class Dense.
LAYERS, NARROW_INPUTS = 5, 16
TWO_STAGES = ["dense_3"]  # dense_0-2 | dense_3-4 + head
STAGE_STARTS = {
    "gpipe": TWO_STAGES,
    "1f1b": TWO_STAGES,
    "zero_bubble": TWO_STAGES,
    "interleaved": ["dense_2", "dense_3", "dense_4"],
}  # four chunks of one layer
MIB = 2**20


def bubble_worker(args) -> None:
    import keras
    from mpi4py import MPI

    import hyparflow as hf
    from benchmarks.models import mlp, synthetic_data

    keras.config.disable_interactive_logging()
    root = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="hf-bubble-") if hf.rank() == 0 else None)

    def profiled_fit(schedule, m):
        """Train the MLP; rank 0: the job row of the profile."""
        model = mlp(args.width, LAYERS, inputs=NARROW_INPUTS)
        batch_size = args.microbatch_rows * m  # micro-batches of one size at every m
        x, y = synthetic_data(model, batch_size * args.steps)
        log_dir = os.path.join(root, f"{schedule}-{m}")
        strategy = hf.Strategy(
            "model",
            microbatches=m,
            tune_process=True,
            balance=STAGE_STARTS[schedule],
            schedule=schedule,
        )
        profiler = hf.callbacks.ScalingProfiler(log_dir, timeline=False)
        hf.fit(
            model,
            x,
            y,
            batch_size=batch_size,
            epochs=args.epochs,
            verbose=0,
            strategy=strategy,
            callbacks=[profiler],
        )
        if hf.rank() != 0:
            return None
        with open(os.path.join(log_dir, "profile.json")) as f:
            return json.load(f)["job"]

    configs = [(s, m) for m in args.microbatches for s in LABELS][:: -1 if args.reverse else 1]
    results = []
    for schedule, m in configs:
        job = profiled_fit(schedule, m)
        if hf.rank() == 0:
            results.append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "measured": job["bubble_measured"],
                    "theoretical": job["bubble_theoretical"],
                    "simulated": job["bubble_simulated"],
                    "step_ms": job["ms_per_step"]["step"],
                }
            )
    if hf.rank() == 0:
        write_result(args.worker_out, 0, results)


def memory_worker(args) -> None:
    import keras

    import hyparflow as hf
    from benchmarks.models import mlp, synthetic_data
    from hyparflow.memory.resident import peak_bytes, resident_bytes

    keras.config.disable_interactive_logging()
    model = mlp(args.width, 4)
    x, y = synthetic_data(model, args.memory_batch * 3)
    before = resident_bytes()
    m = args.memory_microbatches
    strategy = hf.Strategy("model", microbatches=m, schedule=args.schedule, tune_process=True)
    hf.fit(model, x, y, batch_size=args.memory_batch, epochs=2, verbose=0, strategy=strategy)
    peak = peak_bytes()
    write_result(args.worker_out, hf.rank(), {"peak": peak, "growth": peak - before})


def worker(args) -> None:
    (memory_worker if args.schedule else bubble_worker)(args)


def _bubble_records(args) -> list[dict]:
    runs = []
    for round_ in range(args.rounds):
        worker_args = _common(args) + ["--microbatches", *args.microbatches]
        runs += run_worker(__file__, worker_args + (["--reverse"] if round_ % 2 else []), np=2)[0]
    records = []
    for m in args.microbatches:
        mine = [r for r in runs if r["microbatches"] == m]

        def point(name, values, unit, series, m=m):  # a point at m on a line of the plot
            return measurement(
                FIGURE,
                f"{name}, m={m}",
                values,
                unit,
                series=series,
                x=m,
                x_label="micro-batches m",
            )

        formula = next(r["theoretical"] for r in mine if r["schedule"] == "1f1b")
        records.append(point("formula (p-1)/(m+p-1)", [formula], "bubble", "formula"))
        by = {s: [r for r in mine if r["schedule"] == s] for s in LABELS}
        for schedule, label in LABELS.items():
            for kind in ("measured", "simulated"):
                values = [r[kind] for r in by[schedule]]
                records.append(point(f"{label} {kind}", values, "bubble", f"{label} {kind}"))
            steps = [r["step_ms"] for r in by[schedule]]
            records.append(point(f"{label} step time", steps, "ms per step", label))
            if schedule != "gpipe" and m > 1:  # each against its own formula
                excess = [r["measured"] - r["theoretical"] for r in by[schedule]]
                name = f"{label} bubble minus its formula (points/100), m={m}"
                records.append(target(FIGURE, name, excess, "<= 0.05"))
        for new, old in PAIRS if m > 1 else []:  # paired: the runs of one launch
            pairs, label = list(zip(by[new], by[old], strict=True)), LABELS[new]
            gap = [a["measured"] - b["measured"] for a, b in pairs]
            name = f"{label} bubble minus {LABELS[old]}'s, m={m}"
            records.append(target(FIGURE, name, gap, "< 0"))
            ratio = [a["step_ms"] / b["step_ms"] for a, b in pairs]
            name = f"{label} / {LABELS[old]} step time, m={m}"
            records.append(measurement(FIGURE, name, ratio, "ratio"))
            formula = [a["theoretical"] for a, _ in pairs]
            records.append(point(f"{label} formula", formula, "bubble", f"{label} formula"))
    return records


def _memory_records(args) -> list[dict]:
    peaks, growth = ({s: {0: [], 1: []} for s in SCHEDULES} for _ in range(2))
    for round_ in range(args.rounds):
        for schedule in SCHEDULES if round_ % 2 == 0 else SCHEDULES[::-1]:
            worker_args = _common(args) + ["--schedule", schedule]
            for rank, r in enumerate(run_worker(__file__, worker_args, np=2)):
                peaks[schedule][rank].append(r["peak"] / MIB)
                growth[schedule][rank].append(r["growth"] / MIB)
    records, m = [], args.memory_microbatches
    for schedule, label in ((s, LABELS[s]) for s in SCHEDULES):
        for rank in (0, 1):
            where = f"{label}, stage {rank}, m={m}, batch {args.memory_batch}"
            records.append(measurement(FIGURE, f"peak RSS, {where}", peaks[schedule][rank], "MiB"))
            name = f"peak RSS minus RSS before fit, {where}"
            records.append(measurement(FIGURE, name, growth[schedule][rank], "MiB"))
    return records


def run(args) -> list[dict]:
    return _bubble_records(args) + _memory_records(args)


def _common(args) -> list:
    return cli.flags(
        args, "width", "microbatch_rows", "steps", "epochs", "memory_batch", "memory_microbatches"
    )


def arguments(argv=None):
    p = cli.parser(
        __doc__,
        rounds=3,
        width=1024,
        microbatch_rows=128,
        steps=10,
        epochs=2,
        memory_batch=4096,
        memory_microbatches=8,
    )
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--schedule", choices=SCHEDULES, help="worker: memory run of one schedule")
    p.add_argument("--reverse", action="store_true", help="worker: configurations reversed")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.microbatches, args.steps, args.width = 1, [1, 4], 3, 128
        args.memory_batch = 512
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
