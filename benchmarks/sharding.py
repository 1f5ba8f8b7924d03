"""Sharding over replicas at R=2: plain data parallel, ZeRO-1, ZeRO-2 and ZeRO-3, samples/s, bytes.

Run: .venv/bin/python benchmarks/sharding.py [--quick] [--repeats 5]
     (starts `mpirun -np 2` itself: one core per rank on a 2-core machine)

Two models, Adam, global batch 128, 1 micro-batch (the default) and 2, each a run of its own: a
transformer encoder of dense inputs (`transformer`: 4 blocks of width 256, 4 heads, 32
positions, about 3.2 M parameters; no embedding table, so the stage can be cut into segments)
and an MLP of 4 x Dense(1024) (4.2 M parameters); and, with `--models subclassed`, the same
transformer as a subclassed model (no layer graph: ZeRO-3 gathers each block around its call
inside the step, `engine/stages/layer_gathering.py`). Each layout trains its own model object in
one launch, epochs interleaved and the order rotated (`interleaved_epochs`); samples/s over the
epochs after the first, the ratio to plain data parallel paired by round. Bytes per rank: what
the optimizer state, the step's gradient sums and the weights hold (the gradients a ZeRO-2 rank
keeps are its slices plus one segment's; the weights a ZeRO-3 rank keeps, its slices), and what
a rank sends per step (ZeRO-3: each micro-batch gathers each segment's weights twice, for its
forward and for its backward's recomputation, but the last segment's once: its backward follows
its forward under 1F1B and differentiates that forward's tape; the subclassed model's blocks
gather for each forward and backward). Every layout runs the 1F1B order: at one stage it only
orders each micro-batch's backward right after its forward. "Compute hid": the share of
ZeRO-3's gather time on the gather thread that its steps did not wait for, over the run.
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

FIGURE = "sharding"
TITLE = "Sharding over replicas: plain data parallel, ZeRO-1, ZeRO-2 and ZeRO-3 at R=2"
MIB = 2**20
LAYOUTS = {  # name -> Strategy keywords beside `kind="data"`
    "plain": {},
    "ZeRO-1": {"shard_optimizer": True},
    "ZeRO-2": {"shard_gradients": True},
    "ZeRO-3": {"shard_weights": True},
}
MODELS = ("transformer", "mlp", "subclassed")


def _model(name: str, quick: bool):
    from benchmarks.models import mlp, subclassed_transformer, transformer

    if name == "mlp":
        return mlp(128 if quick else 1024, 4, optimizer="adam")
    build = subclassed_transformer if name == "subclassed" else transformer
    return build(64 if quick else 256, 2 if quick else 4, heads=4, positions=32)


def worker(args) -> None:
    import keras

    import hyparflow as hf
    from benchmarks.harness.timing import interleaved_epochs
    from benchmarks.models import synthetic_data

    keras.config.disable_interactive_logging()
    strategies = {
        # 1F1B: each micro-batch's backward right after its forward, as plain data
        # parallelism's fused runner does; ZeRO-3's last segment then reuses its forward
        name: hf.Strategy(
            "data",
            microbatches=args.microbatches[0],
            schedule="1f1b",
            tune_process=True,
            **options,
        )
        for name, options in LAYOUTS.items()
    }
    models = {name: _model(args.model, args.quick) for name in LAYOUTS}
    shaped = _model("transformer", args.quick) if args.model == "subclassed" else models["plain"]
    x, y = synthetic_data(shaped, args.batch_size * args.steps)  # a layer graph's input shape
    setups = {name: (models[name], strategies[name]) for name in LAYOUTS}
    seconds = interleaved_epochs(setups, x, y, args.batch_size, args.repeats)
    write_result(
        args.worker_out,
        hf.rank(),
        {
            "seconds": seconds,
            "bytes": {name: _bytes(models[name]) for name in LAYOUTS},
            "hidden": _hidden(models["ZeRO-3"]),
        },
    )


def _hidden(model) -> float:
    """The share of ZeRO-3's gather time (on the gather thread) its steps did not wait for,
    over the whole run: the profiler's "compute hid" figure."""
    from hyparflow.engine.sharded_optimizer.sharded_weights import TRANSFER_TAG, WAIT_TAG

    traffic = model._hyparflow_trainer[1].traffic
    gathered, waited = traffic.of(TRANSFER_TAG).seconds, traffic.of(WAIT_TAG).seconds
    return max(0.0, 1.0 - waited / gathered) if gathered > 0 else 0.0


def _bytes(model) -> dict:
    """This rank's optimizer state, gradient sums and bytes sent per step under its layout."""
    import numpy as np

    trainer = model._hyparflow_trainer[1]
    sharded = trainer.parts.sharded_update
    slots = sum(int(np.prod(v.shape)) * 4 for v in model.optimizer.variables if len(v.shape))
    parameters = sum(int(np.prod(v.shape)) * 4 for v in trainer.variables)
    if sharded is None:  # the ring allreduce of the whole gradient
        replicas = trainer.topology.num_replicas
        sent, kept = 2 * (replicas - 1) * parameters // replicas, parameters
    else:
        step = sharded.step_bytes
        scatters = trainer.strategy.microbatches if trainer.shards_gradients else 1
        # ZeRO-3 gathers each segment for each forward and backward instead of once a step,
        # but the last segment's backward, which follows its forward (1F1B), gathers nothing
        gathers = 2 * trainer.strategy.microbatches if trainer.shards_weights else 1
        sent = scatters * step["reduce_scatter"] + gathers * step["allgather"]
        # (a subclassed model's layers gather in its graph: each one's backward gathers too)
        if trainer.shards_weights and not trainer.parts.runner.slice_gradients:
            last = sum(g.allgather_bytes for g in sharded.segments[-1])
            sent -= trainer.strategy.microbatches * last
        slices = sum(g.layout.slice_size * 4 for g in sharded.groups)
        segment = max(sum(g.layout.length * 4 for g in groups) for groups in sharded.segments)
        # ZeRO-2: its slices of the sums and one segment's gradients; else the whole gradients
        kept = slices + segment if trainer.shards_gradients else parameters
    weights = slices if sharded is not None and trainer.shards_weights else parameters
    return {
        "optimizer": slots,
        "gradients": kept,
        "weights": weights,
        "sent": sent,
        "parameters": parameters,
    }


def run(args) -> list[dict]:
    records = []
    for name in args.models:
        for microbatches in args.microbatches:
            quick = ["--quick"] if args.quick else []
            fixed = [*cli.flags(args, *SHAPE, "repeats"), *quick, "--model", name]
            ranks = run_worker(__file__, [*fixed, "--microbatches", microbatches], np=2)
            records += _records(name, microbatches, args, ranks[0])
    return records


def _records(name: str, microbatches: int, args, result: dict) -> list[dict]:
    seconds, sizes = result["seconds"], result["bytes"]
    samples = args.batch_size * args.steps
    setup = f"{name}, R=2, batch {args.batch_size}, M={microbatches}"
    records = []
    for layout in LAYOUTS:
        rate = [samples / s for s in seconds[layout]]
        records.append(measurement(FIGURE, f"{layout}: samples/s ({setup})", rate, "samples/s"))
        for what in ("optimizer", "gradients", "weights", "sent"):
            value = sizes[layout][what] / MIB
            unit = "MiB per step" if what == "sent" else "MiB per rank"
            label = {
                "optimizer": "optimizer state",
                "gradients": "gradients held",
                "weights": "weights held between steps",
            }.get(what, what)
            records.append(measurement(FIGURE, f"{layout}: {label} ({setup})", [value], unit))
        if layout != "plain":
            ratio = paired_ratios(seconds["plain"], seconds[layout])
            records.append(
                measurement(FIGURE, f"{layout} / plain samples/s ({setup})", ratio, "ratio")
            )
    hidden = [100 * result["hidden"]]
    records.append(measurement(FIGURE, f"ZeRO-3: gather time compute hid ({setup})", hidden, "%"))
    print(
        f"{name}, M={microbatches}: "
        + ", ".join(
            f"{k} {statistics.median(samples / s for s in seconds[k]):.0f}/s" for k in LAYOUTS
        ),
        file=sys.stderr,
    )
    return records


SHAPE = ("batch_size", "steps")


def arguments(argv=None):
    p = cli.parser(__doc__, repeats=5, batch_size=128, steps=8)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--model", choices=MODELS, help="worker: the model it trains")
    p.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        default=[1, 2],
        help="micro-batches per replica, each a run of its own (1: Strategy's default)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 2
    args.title = f"{TITLE} ({', '.join(args.models)})"
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
