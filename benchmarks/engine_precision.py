"""Engine options, mixed precision: bytes on the wire and step time, float32 vs mixed_float16
vs mixed_bfloat16 (2-stage 1F1B pipeline).

Run: .venv/bin/python benchmarks/engine_precision.py [--rounds 3]   (starts `mpirun -np 2`)

The Keras dtype policy is set before the model is built (`keras.config.set_dtype_policy`), so
each policy runs in its own launch; launches alternate within a round. Reported: epoch time
(samples/s over the epochs after the first), the bytes each step moves between the stages
(activations forward plus their gradients back, from the channel's boundary tensors: 16-bit
under both mixed policies) and the bytes a replica reduction of the stage's gradients would
move (the variables, and so their gradients, stay float32 under mixed policies).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402

FIGURE = "precision"
TITLE = "Engine options: mixed precision (bytes on the wire, time)"
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
MIB = 2**20


def worker(args) -> None:
    import keras
    import numpy as np

    import hyparflow as hf
    from benchmarks.harness.timing import epoch_timer
    from benchmarks.models import mlp, synthetic_data

    keras.config.disable_interactive_logging()
    keras.config.set_dtype_policy(args.policy)
    model = mlp(args.width, args.depth)
    x, y = synthetic_data(model, args.batch_size * args.steps)
    timer = epoch_timer()
    strategy = hf.Strategy("model", microbatches=args.microbatches, schedule="1f1b")
    hf.fit(
        model,
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=0,
        strategy=strategy,
        callbacks=[timer],
    )
    trainer = model._hyparflow_trainer[1]
    if hf.rank() == 0:
        (_, channel), *_ = trainer._channels.values()  # stage 0's link to stage 1
        row = {d: sum(s.row_bytes for s in channel.specs(d)) for d in ("forward", "backward")}
        grads = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in trainer.variables)
        write_result(
            args.worker_out,
            0,
            {
                "samples_per_s": [args.batch_size * args.steps / s for s in timer.seconds[1:]],
                "p2p_bytes": args.batch_size * (row["forward"] + row["backward"]),
                "gradient_bytes": grads,
                "boundary_dtypes": [s.dtype.name for s in channel.specs("forward")],
            },
        )


def run(args) -> list[dict]:
    rates = {p: [] for p in POLICIES}
    info = {}
    for round_ in range(args.rounds):
        for policy in POLICIES if round_ % 2 == 0 else POLICIES[::-1]:
            worker_args = [
                "--policy",
                policy,
                "--width",
                args.width,
                "--depth",
                args.depth,
                "--batch-size",
                args.batch_size,
                "--steps",
                args.steps,
                "--epochs",
                args.epochs,
                "--microbatches",
                args.microbatches,
            ]
            result = run_worker(__file__, worker_args, np=2)[0]
            rates[policy].append(statistics.median(result["samples_per_s"]))
            info[policy] = result
    setup = f"2-stage 1F1B, m={args.microbatches}, MLP {args.depth}x{args.width}"
    records = []
    for policy in POLICIES:
        dtypes = "/".join(sorted(set(info[policy]["boundary_dtypes"])))
        records.append(
            measurement(
                FIGURE,
                f"{policy}: samples/s ({setup})",
                rates[policy],
                "samples/s",
                boundary_dtype=dtypes,
            )
        )
        records.append(
            measurement(
                FIGURE,
                f"{policy}: stage-to-stage bytes per step",
                [info[policy]["p2p_bytes"] / MIB],
                "MiB per step",
            )
        )
        records.append(
            measurement(
                FIGURE,
                f"{policy}: stage 0 gradient bytes per reduction",
                [info[policy]["gradient_bytes"] / MIB],
                "MiB per step",
            )
        )
    for policy in POLICIES[1:]:
        records.append(
            measurement(
                FIGURE,
                f"{policy} / float32 samples/s",
                paired_ratios(rates[policy], rates["float32"]),
                "ratio",
            )
        )
    return records


def arguments(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--epochs", type=int, default=3, help="the first (tracing) is not counted")
    p.add_argument("--policy", choices=POLICIES, help="worker: the dtype policy")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.width, args.steps, args.epochs = 1, 128, 3, 2
    return args


def main(argv=None):
    return cli.entry(arguments(argv), worker, run)


if __name__ == "__main__":
    main()
