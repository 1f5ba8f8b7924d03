"""Engine options, recompute: activation memory saved and time it costs (2-stage GPipe).

Run: .venv/bin/python benchmarks/engine_recompute.py [--repeats 7] [--rounds 2]
     (starts `mpirun -np 2` itself)

A 2-stage GPipe pipeline (8 micro-batches: GPipe keeps all 8 micro-batches' activations until
the backward) of an activation-heavy MLP (16 Dense layers of 256 units, batch 8192): with
`recompute=True` a stage keeps only each micro-batch's inputs and runs its forward again in the
backward. Time: one launch, epochs interleaved (two model objects), paired ratio on / off.
Memory: one launch per setting (alternating), each rank's peak resident memory and its growth
over the resident memory before training.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402

FIGURE = "recompute"
TITLE = "Engine options: activation recomputation (memory saved, time cost)"
MIB = 2**20


def _strategy(recompute: bool, microbatches: int):
    import hyparflow as hf

    return hf.Strategy("model", microbatches=microbatches, schedule="gpipe", recompute=recompute)


def worker(args) -> None:
    import keras

    import hyparflow as hf
    from benchmarks.harness.interleave import interleaved_epochs
    from benchmarks.harness.memory import peak_rss_bytes, rss_bytes
    from benchmarks.models import mlp, synthetic_data

    keras.config.disable_interactive_logging()
    m = args.microbatches
    if args.memory is None:  # time, interleaved
        models = [mlp(args.width, args.depth) for _ in range(2)]
        x, y = synthetic_data(models[0], args.batch_size * args.steps)
        setups = {"on": (models[0], _strategy(True, m)), "off": (models[1], _strategy(False, m))}
        seconds = interleaved_epochs(setups, x, y, args.batch_size, args.repeats)
        if hf.rank() == 0:
            write_result(args.worker_out, 0, seconds)
        return
    model = mlp(args.width, args.depth)
    x, y = synthetic_data(model, args.batch_size * 2)
    before = rss_bytes()
    hf.fit(
        model,
        x,
        y,
        batch_size=args.batch_size,
        epochs=2,
        verbose=0,
        strategy=_strategy(args.memory == "on", m),
    )
    write_result(args.worker_out, hf.rank(), {"peak": peak_rss_bytes(), "before": before})


def run(args) -> list[dict]:
    shape = [
        "--width",
        args.width,
        "--depth",
        args.depth,
        "--batch-size",
        args.batch_size,
        "--microbatches",
        args.microbatches,
    ]
    setup = (
        f"2-stage GPipe, m={args.microbatches}, MLP {args.depth}x{args.width}, "
        f"batch {args.batch_size}"
    )
    seconds = run_worker(
        __file__, [*shape, "--repeats", args.repeats, "--steps", args.steps], np=2
    )[0]
    records = [
        measurement(FIGURE, f"recompute={key == 'on'}: s per epoch ({setup})", seconds[key], "s")
        for key in ("off", "on")
    ]
    records.append(
        measurement(
            FIGURE,
            "time cost of recompute (on / off)",
            paired_ratios(seconds["on"], seconds["off"]),
            "ratio",
        )
    )
    peaks = {key: {0: [], 1: []} for key in ("off", "on")}
    growth = {key: {0: [], 1: []} for key in ("off", "on")}
    for round_ in range(args.rounds):
        for key in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            for rank, r in enumerate(run_worker(__file__, [*shape, "--memory", key], np=2)):
                peaks[key][rank].append(r["peak"] / MIB)
                growth[key][rank].append((r["peak"] - r["before"]) / MIB)
    for key in ("off", "on"):
        for rank in (0, 1):
            where = f"recompute={key == 'on'}, stage {rank}"
            records.append(measurement(FIGURE, f"peak RSS, {where}", peaks[key][rank], "MiB"))
            records.append(
                measurement(
                    FIGURE, f"peak RSS minus RSS before fit, {where}", growth[key][rank], "MiB"
                )
            )
    for rank in (0, 1):
        saved = [a - b for a, b in zip(growth["off"][rank], growth["on"][rank])]
        records.append(
            measurement(FIGURE, f"memory saved by recompute, stage {rank}", saved, "MiB")
        )
    return records


def arguments(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--rounds", type=int, default=2, help="memory launches per setting")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per epoch")
    p.add_argument("--memory", choices=["on", "off"], help="worker: memory run of one setting")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.batch_size, args.depth = 1, 512, 4
    return args


def main(argv=None):
    return cli.entry(arguments(argv), worker, run)


if __name__ == "__main__":
    main()
