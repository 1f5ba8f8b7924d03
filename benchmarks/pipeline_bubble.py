"""Figure 5, pipeline: measured bubble vs formula, GPipe, 1F1B, ZB-H1 and interleaved 1F1B; peak
memory per rank.

Run: .venv/bin/python benchmarks/pipeline_bubble.py [--rounds 3] [--microbatches 1 2 4 8 16]
     (starts `mpirun -np 2` itself)

Bubble: a 2-stage MLP pipeline trained with `hf.fit` and the `ScalingProfiler` for each
schedule and micro-batch count m (one launch per round, order reversed every round). Measured:
the profiler's `1 - compute / makespan` over steady steps; formula: (p-1)/(m+p-1), and for
ZB-H1 (split backward) its idle fraction at the measured F, B, W times; simulated: the schedule
with the measured stage times. Targets: 1F1B and ZB-H1 within 5 points of their formulas,
ZB-H1's bubble below 1F1B's (paired); step times beside. Stages are balanced by measurement:
for each m the first layer's input is widened (secant steps on profiled stage times) until
both stages compute as long, since the last stage also computes the head and the loss.
Interleaved 1F1B (v = 2) runs on an MLP whose four hidden layers are alike (input as wide as
them), one layer a chunk (the head, 1% of a layer, joins the last); paired in each launch with
1F1B on the same model cut into two stages of two layers. Targets: within 5 points of
(p-1)/(vm+p-1), and below that 1F1B's bubble.

Memory: each schedule in its own launch (alternating), a bigger batch and m = 8; each rank's
peak resident memory (VmHWM) and its growth over the memory before training.
"""

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
TITLE = "(5) Pipeline: measured bubble vs formula (GPipe, 1F1B, ZB-H1), memory per rank"
LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "zero_bubble": "ZB-H1"}
SCHEDULES = tuple(LABELS)
# On the even MLP: where its stages begin (interleaved: P * v = 4 chunks of one layer each)
EVEN = {"interleaved": ["dense_1", "dense_2", "dense_3"], "1f1b_even": ["dense_2"]}
EVEN_LABELS = {"interleaved": "Interleaved v=2", "1f1b_even": "1F1B (even MLP)"}
MIB = 2**20


def bubble_worker(args) -> None:
    import keras
    from mpi4py import MPI

    import hyparflow as hf
    from benchmarks.models import mlp, synthetic_data

    keras.config.disable_interactive_logging()
    root = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="hf-bubble-") if hf.rank() == 0 else None)

    def profiled_fit(inputs, schedule, m, name):
        """Train the MLP on `inputs` features; rank 0: the job row, each stage's compute."""
        even = EVEN.get(schedule)
        model = mlp(args.width, 4, inputs=args.width if even else inputs)
        x, y = synthetic_data(model, args.batch_size * args.steps)
        log_dir = os.path.join(root, name)
        options = dict(schedule="1f1b" if schedule == "1f1b_even" else schedule)
        options |= dict(balance=even) if even else {}
        strategy = hf.Strategy("model", microbatches=m, tune_process=True, **options)
        profiler = hf.callbacks.ScalingProfiler(log_dir, timeline=False)
        hf.fit(model, x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
               strategy=strategy, callbacks=[profiler])  # fmt: skip
        if hf.rank() != 0:
            return None, None
        with open(os.path.join(log_dir, "profile.json")) as f:
            profile = json.load(f)
        compute = {r["rank"]: r["ms_per_step"]["compute"] for r in profile["ranks"]}
        return profile["job"], [compute[0], compute[1]]

    # Per micro-batch count: the last stage's fixed per-micro-batch costs (loss, head) weigh
    # more the smaller the micro-batches, so one width cannot balance every m.
    inputs = {m: balanced_inputs(args.width, m, profiled_fit) for m in args.microbatches}
    schedules = SCHEDULES + tuple(EVEN)
    configs = [(s, m) for m in args.microbatches for s in schedules][:: -1 if args.reverse else 1]
    results = []
    for schedule, m in configs:
        job, _ = profiled_fit(inputs[m], schedule, m, f"{schedule}-{m}")
        if hf.rank() == 0:
            results.append({
                "schedule": schedule, "microbatches": m, "measured": job["bubble_measured"],
                "theoretical": job["bubble_theoretical"], "simulated": job["bubble_simulated"],
                "step_ms": job["ms_per_step"]["step"], "inputs": inputs[m],
            })  # fmt: skip
    if hf.rank() == 0:
        write_result(args.worker_out, 0, results)


def balanced_inputs(width: int, m: int, profiled_fit) -> int:
    """The first layer's input width at which both stages' compute per step meet with `m`
    micro-batches: a secant step from widths 1x and 2x, then one from the two closest to
    balance (stage 0's time is only roughly linear in the width)."""
    from mpi4py import MPI

    rank0 = MPI.COMM_WORLD.Get_rank() == 0
    lowest, highest = width // 2, 4 * width
    measured = {d: profiled_fit(d, "1f1b", m, f"balance-{m}-{d}")[1] for d in (width, 2 * width)}
    inputs = None
    for _ in range(2):
        if rank0:
            inputs = _secant_width(measured, lowest, highest)
        inputs = MPI.COMM_WORLD.bcast(inputs)
        if inputs in measured:
            break
        measured[inputs] = profiled_fit(inputs, "1f1b", m, f"balance-{m}-{inputs}")[1]
    if rank0:
        inputs = _secant_width(measured, lowest, highest)
    return MPI.COMM_WORLD.bcast(inputs)


def _secant_width(measured: dict, lowest: int, highest: int) -> int:
    """Where stage 0's compute (linear between the two measured widths whose imbalance is
    smallest) meets the last stage's (their mean), rounded to 64 and clamped."""
    gap = {d: times[0] - times[1] for d, times in measured.items()}  # stage 0 minus stage 1
    a, b = sorted(sorted(gap, key=lambda d: abs(gap[d]))[:2])
    slope = (gap[b] - gap[a]) / (b - a)
    exact = a - gap[a] / slope if slope > 0 else a
    return int(min(highest, max(lowest, round(exact / 64) * 64)))


def memory_worker(args) -> None:
    import keras

    import hyparflow as hf
    from benchmarks.models import mlp, synthetic_data
    from hyparflow.memory.resident import peak_bytes, resident_bytes

    keras.config.disable_interactive_logging()
    model = mlp(args.width, 4)
    x, y = synthetic_data(model, args.memory_batch * 3)
    before = resident_bytes()
    strategy = hf.Strategy(
        "model", microbatches=args.memory_microbatches, schedule=args.schedule, tune_process=True
    )
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
            return measurement(FIGURE, f"{name}, m={m}", values, unit, series=series, x=m,
                               x_label="micro-batches m")  # fmt: skip

        widths = [r["inputs"] for r in mine if r["schedule"] == SCHEDULES[0]]
        name = f"first layer's input width chosen for balance (one per launch), m={m}"
        records.append(measurement(FIGURE, name, widths, "features"))
        formula = next(r["theoretical"] for r in mine if r["schedule"] == "1f1b")
        records.append(point("formula (p-1)/(m+p-1)", [formula], "bubble", "formula"))
        by = {s: [r for r in mine if r["schedule"] == s] for s in SCHEDULES}
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
        pairs = list(zip(by["zero_bubble"], by["1f1b"], strict=True)) if m > 1 else []
        if pairs:  # paired: the runs of one launch
            gap = [z["measured"] - o["measured"] for z, o in pairs]
            records.append(target(FIGURE, f"ZB-H1 bubble minus 1F1B's, m={m}", gap, "< 0"))
            ratio = [z["step_ms"] / o["step_ms"] for z, o in pairs]
            records.append(measurement(FIGURE, f"ZB-H1 / 1F1B step time, m={m}", ratio, "ratio"))
            zb = [z["theoretical"] for z, _ in pairs]
            records.append(point("ZB-H1 formula", zb, "bubble", "ZB-H1 formula"))
        records += _interleaved_records(mine, m, point)
    return records


def _interleaved_records(mine: list[dict], m: int, point) -> list[dict]:
    """Interleaved 1F1B against its formula and, paired by launch, against 1F1B on the same
    even MLP."""
    by = {s: [r for r in mine if r["schedule"] == s] for s in EVEN}
    records = []
    for schedule, label in EVEN_LABELS.items():
        for kind in ("measured", "theoretical", "simulated"):
            values = [r[kind] for r in by[schedule]]
            records.append(point(f"{label} {kind}", values, "bubble", f"{label} {kind}"))
        steps = [r["step_ms"] for r in by[schedule]]
        records.append(point(f"{label} step time", steps, "ms per step", label))
    excess = [r["measured"] - r["theoretical"] for r in by["interleaved"]]
    name = f"Interleaved v=2 bubble minus its formula (points/100), m={m}"
    records.append(target(FIGURE, name, excess, "<= 0.05"))
    pairs = list(zip(by["interleaved"], by["1f1b_even"], strict=True))
    gap = [i["measured"] - o["measured"] for i, o in pairs]
    records.append(target(FIGURE, f"Interleaved bubble minus 1F1B's (even MLP), m={m}", gap, "< 0"))
    ratio = [i["step_ms"] / o["step_ms"] for i, o in pairs]
    name = f"Interleaved / 1F1B step time (even MLP), m={m}"
    records.append(measurement(FIGURE, name, ratio, "ratio"))
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
    for schedule, label in LABELS.items():
        for rank in (0, 1):
            where = f"{label}, stage {rank}, m={m}, batch {args.memory_batch}"
            records.append(measurement(FIGURE, f"peak RSS, {where}", peaks[schedule][rank], "MiB"))
            name = f"peak RSS minus RSS before fit, {where}"
            records.append(measurement(FIGURE, name, growth[schedule][rank], "MiB"))
    return records


def run(args) -> list[dict]:
    return _bubble_records(args) + _memory_records(args)


def _common(args) -> list:
    return cli.flags(args, "width", "batch_size", "steps", "epochs", "memory_batch",
                     "memory_microbatches")  # fmt: skip


def arguments(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=10, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--memory-batch", type=int, default=4096)
    p.add_argument("--memory-microbatches", type=int, default=8)
    p.add_argument("--schedule", choices=SCHEDULES, help="worker: memory run of one schedule")
    p.add_argument("--reverse", action="store_true", help="worker: configurations reversed")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.microbatches, args.steps, args.width = 1, [1, 4], 3, 128
        args.memory_batch = 512
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
