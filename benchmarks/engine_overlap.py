"""Engine options, overlap: overlap_groups on/off (data parallel) and overlap_p2p on/off (1F1B).

Run: .venv/bin/python benchmarks/engine_overlap.py [--repeats 7]   (starts `mpirun -np 2`)

- `overlap_groups=4` vs 1: data parallel on 2 ranks, an MLP whose gradients (6 x 1024 x 1024
  float32, 24 MiB) take a visible share of the step; with groups, each stage's backward is cut
  into 4 segments and a finished segment's gradients are reduced on a background thread while
  earlier segments are still in backward.
- `overlap_p2p=True` vs False: a 2-stage 1F1B pipeline with 8 micro-batches; True posts all of
  a step's receives up front, False posts each when its action needs it.

Each pair runs in one launch, epochs interleaved (two model objects, one per setting); the gain
is the paired ratio off / on of epoch times (> 1: the option helps).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402

FIGURE = "overlap"
TITLE = "Engine options: overlap_groups and overlap_p2p"
EXPERIMENTS = {
    "groups": ("data parallel 1x2, MLP 6x1024, batch 256", "overlap_groups=4", "overlap_groups=1"),
    "p2p": (
        "model parallel 2x1, 1F1B, m=8, MLP 4x1024, batch 512",
        "overlap_p2p=True",
        "overlap_p2p=False",
    ),
}


def worker(args) -> None:
    import keras

    import hyparflow as hf
    from benchmarks.harness.interleave import interleaved_epochs
    from benchmarks.models import mlp, synthetic_data

    keras.config.disable_interactive_logging()
    if args.experiment == "groups":
        depth, batch = 6, 256
        on = hf.Strategy("data", overlap_groups=4)
        off = hf.Strategy("data", overlap_groups=1)
    else:
        depth, batch = 4, 512
        on = hf.Strategy("model", microbatches=8, schedule="1f1b", overlap_p2p=True)
        off = hf.Strategy("model", microbatches=8, schedule="1f1b", overlap_p2p=False)
    models = [mlp(args.width, depth) for _ in range(2)]
    x, y = synthetic_data(models[0], batch * args.steps)
    seconds = interleaved_epochs(
        {"on": (models[0], on), "off": (models[1], off)}, x, y, batch, args.repeats
    )
    if hf.rank() == 0:
        write_result(args.worker_out, 0, seconds)


def run(args) -> list[dict]:
    records = []
    for experiment, (setup, on_label, off_label) in EXPERIMENTS.items():
        worker_args = [
            "--experiment",
            experiment,
            "--repeats",
            args.repeats,
            "--steps",
            args.steps,
            "--width",
            args.width,
        ]
        seconds = run_worker(__file__, worker_args, np=2)[0]
        for key, name in (("on", on_label), ("off", off_label)):
            records.append(
                measurement(
                    FIGURE, f"{name}: s per epoch ({setup})", seconds[key], "s", steps=args.steps
                )
            )
        gain = paired_ratios(seconds["off"], seconds["on"])
        records.append(
            measurement(FIGURE, f"gain of {on_label} (off / on time), {setup}", gain, "ratio")
        )
    return records


def arguments(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--steps", type=int, default=20, help="steps per epoch")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--experiment", choices=sorted(EXPERIMENTS), help="worker: which pair")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.width = 3, 128
    return args


def main(argv=None):
    return cli.entry(arguments(argv), worker, run)


if __name__ == "__main__":
    main()
