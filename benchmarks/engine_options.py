"""Engine options on 2 ranks: overlap_groups and overlap_p2p, recompute, mixed precision.

Run: .venv/bin/python benchmarks/engine_options.py --option {overlap,recompute,precision}
     (starts `mpirun -np 2` itself)

- overlap: `overlap_groups=4` vs 1 (data parallel, an MLP whose 24 MiB of gradients take a
  visible share of the step; each finished backward segment's gradients are reduced on a
  background thread) and `overlap_p2p=True` vs False (2-stage 1F1B, 8 micro-batches: all of a
  step's receives posted up front vs each when its action needs it). Gain: paired off / on.
- recompute: 2-stage GPipe, 8 micro-batches, an activation-heavy MLP (16 x 256, batch 8192);
  time paired on / off; memory from one launch per setting (alternating): each rank's peak
  resident memory and its growth over the resident memory before training.
- precision: float32, mixed_float16, mixed_bfloat16 on a 2-stage 1F1B pipeline, one launch each
  (alternating): samples/s after the first epoch, bytes between the stages per step (the
  boundary tensors) and the bytes a replica reduction of stage 0's gradients would move.

Time pairs run in one launch, epochs interleaved (one model object per setting).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402

MIB = 2**20
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
OPTIONS = {  # option -> (title, defaults, quick-mode overrides)
    "overlap": (
        "Engine options: overlap_groups and overlap_p2p",
        dict(width=1024, depth=4, batch_size=512, microbatches=8, steps=20),
        dict(steps=3, width=128),
    ),
    "recompute": (
        "Engine options: activation recomputation (memory saved, time cost)",
        dict(width=256, depth=16, batch_size=8192, microbatches=8, steps=3, rounds=2),
        dict(rounds=1, batch_size=512, depth=4),
    ),
    "precision": (
        "Engine options: mixed precision (bytes on the wire, time)",
        dict(width=1024, depth=4, batch_size=512, microbatches=4, steps=10, epochs=3, rounds=3),
        dict(rounds=1, width=128, steps=3, epochs=2),
    ),
}
OVERLAP = {  # worker run -> (setup, label on, label off, depth, batch size)
    "groups": (
        "data parallel 1x2, MLP 6x1024, batch 256",
        "overlap_groups=4",
        "overlap_groups=1",
        6,
        256,
    ),
    "p2p": (
        "model parallel 2x1, 1F1B, m=8, MLP 4x1024, batch 512",
        "overlap_p2p=True",
        "overlap_p2p=False",
        4,
        512,
    ),
}
SHAPE = ("width", "depth", "batch_size", "microbatches", "steps")


def _pair(run: str, microbatches: int):
    """The (on, off) strategies a time pair compares."""
    import hyparflow as hf

    if run == "groups":
        return [hf.Strategy("data", overlap_groups=g, tune_process=True) for g in (4, 1)]
    if run == "p2p":
        return [
            hf.Strategy(
                "model",
                microbatches=microbatches,
                schedule="1f1b",
                overlap_p2p=o,
                tune_process=True,
            )
            for o in (True, False)
        ]
    return [_gpipe(on, microbatches) for on in (True, False)]


def _gpipe(recompute: bool, microbatches: int):
    import hyparflow as hf

    return hf.Strategy(
        "model", microbatches=microbatches, schedule="gpipe", recompute=recompute, tune_process=True
    )


def worker(args) -> None:
    import keras

    import hyparflow as hf
    from benchmarks.harness.timing import epoch_timer, interleaved_epochs
    from benchmarks.models import mlp, synthetic_data
    from hyparflow.engine.weights import nbytes
    from hyparflow.memory.resident import peak_bytes, resident_bytes

    keras.config.disable_interactive_logging()
    if args.run in POLICIES:
        keras.config.set_dtype_policy(args.run)
    model = mlp(args.width, args.depth)
    if args.run in ("groups", "p2p", "recompute"):
        x, y = synthetic_data(model, args.batch_size * args.steps)
        on, off = _pair(args.run, args.microbatches)
        setups = {"on": (model, on), "off": (mlp(args.width, args.depth), off)}
        seconds = interleaved_epochs(setups, x, y, args.batch_size, args.repeats)
        if hf.rank() == 0:
            write_result(args.worker_out, 0, seconds)
    elif args.run in ("memory-on", "memory-off"):
        x, y = synthetic_data(model, args.batch_size * 2)
        before = resident_bytes()
        strategy = _gpipe(args.run == "memory-on", args.microbatches)
        hf.fit(model, x, y, batch_size=args.batch_size, epochs=2, verbose=0, strategy=strategy)
        write_result(args.worker_out, hf.rank(), {"peak": peak_bytes(), "before": before})
    else:
        x, y = synthetic_data(model, args.batch_size * args.steps)
        timer = epoch_timer()
        strategy = hf.Strategy(
            "model", microbatches=args.microbatches, schedule="1f1b", tune_process=True
        )
        fit = dict(batch_size=args.batch_size, epochs=args.epochs, verbose=0, callbacks=[timer])
        hf.fit(model, x, y, strategy=strategy, **fit)
        trainer = model._hyparflow_trainer[1]
        if hf.rank() == 0:
            (_, channel), *_ = trainer.parts.walk.channels.values()  # stage 0's link to stage 1
            row = {d: sum(s.row_bytes for s in channel.specs(d)) for d in ("forward", "backward")}
            write_result(
                args.worker_out,
                0,
                {
                    "samples_per_s": [args.batch_size * args.steps / s for s in timer.seconds[1:]],
                    "p2p_bytes": args.batch_size * (row["forward"] + row["backward"]),
                    "gradient_bytes": sum(map(nbytes, trainer.variables)),
                    "boundary_dtypes": [s.dtype.name for s in channel.specs("forward")],
                },
            )


def _launch(args, run: str, **shape) -> list:
    fixed = cli.flags(argparse.Namespace(**{**vars(args), **shape}), *SHAPE, "repeats", "epochs")
    return run_worker(__file__, ["--run", run, *fixed], np=2)


def _overlap(args) -> list[dict]:
    records = []
    for run, (setup, on, off, depth, batch) in OVERLAP.items():
        seconds = _launch(args, run, depth=depth, batch_size=batch)[0]
        for key, name in (("on", on), ("off", off)):
            records.append(
                measurement(
                    "overlap", f"{name}: s per epoch ({setup})", seconds[key], "s", steps=args.steps
                )
            )
        gain = paired_ratios(seconds["off"], seconds["on"])
        records.append(
            measurement("overlap", f"gain of {on} (off / on time), {setup}", gain, "ratio")
        )
    return records


def _recompute(args) -> list[dict]:
    setup = (
        f"2-stage GPipe, m={args.microbatches}, MLP {args.depth}x{args.width}, "
        f"batch {args.batch_size}"
    )
    seconds = _launch(args, "recompute")[0]
    records = [
        measurement(
            "recompute", f"recompute={key == 'on'}: s per epoch ({setup})", seconds[key], "s"
        )
        for key in ("off", "on")
    ]
    cost = paired_ratios(seconds["on"], seconds["off"])
    records.append(measurement("recompute", "time cost of recompute (on / off)", cost, "ratio"))
    peaks = {(key, rank): [] for key in ("off", "on") for rank in (0, 1)}
    growth = {(key, rank): [] for key in ("off", "on") for rank in (0, 1)}
    for round_ in range(args.rounds):
        for key in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            for rank, r in enumerate(_launch(args, f"memory-{key}")):
                peaks[key, rank].append(r["peak"] / MIB)
                growth[key, rank].append((r["peak"] - r["before"]) / MIB)
    for key, rank in peaks:
        where = f"recompute={key == 'on'}, stage {rank}"
        records.append(measurement("recompute", f"peak RSS, {where}", peaks[key, rank], "MiB"))
        records.append(
            measurement(
                "recompute", f"peak RSS minus RSS before fit, {where}", growth[key, rank], "MiB"
            )
        )
    for rank in (0, 1):
        saved = [a - b for a, b in zip(growth["off", rank], growth["on", rank], strict=True)]
        records.append(
            measurement("recompute", f"memory saved by recompute, stage {rank}", saved, "MiB")
        )
    return records


def _precision(args) -> list[dict]:
    rates, info = {p: [] for p in POLICIES}, {}
    for round_ in range(args.rounds):
        for policy in POLICIES if round_ % 2 == 0 else POLICIES[::-1]:
            info[policy] = _launch(args, policy)[0]
            rates[policy].append(statistics.median(info[policy]["samples_per_s"]))
    setup = f"2-stage 1F1B, m={args.microbatches}, MLP {args.depth}x{args.width}"
    records = []
    for policy in POLICIES:
        dtypes = "/".join(sorted(set(info[policy]["boundary_dtypes"])))
        records += [
            measurement(
                "precision",
                f"{policy}: samples/s ({setup})",
                rates[policy],
                "samples/s",
                boundary_dtype=dtypes,
            ),
            measurement(
                "precision",
                f"{policy}: stage-to-stage bytes per step",
                [info[policy]["p2p_bytes"] / MIB],
                "MiB per step",
            ),
            measurement(
                "precision",
                f"{policy}: stage 0 gradient bytes per reduction",
                [info[policy]["gradient_bytes"] / MIB],
                "MiB per step",
            ),
        ]
    for policy in POLICIES[1:]:
        ratio = paired_ratios(rates[policy], rates["float32"])
        records.append(measurement("precision", f"{policy} / float32 samples/s", ratio, "ratio"))
    return records


def run(args) -> list[dict]:
    return FIGURES[args.option](args)


FIGURES = {"overlap": _overlap, "recompute": _recompute, "precision": _precision}


def arguments(argv=None):
    p = cli.parser(__doc__, rounds=None, epochs=3, **dict.fromkeys(SHAPE))  # None: from OPTIONS
    p.add_argument("--option", choices=sorted(OPTIONS), default="overlap")
    p.add_argument("--run", help="worker: which setting or pair")
    args = p.parse_args(argv)
    title, defaults, quick = OPTIONS[args.option]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        vars(args).update(quick)
    args.title = title
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
