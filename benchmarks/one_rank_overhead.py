"""Figure 1, overhead on one rank: epoch time of hf.fit and of the engine vs model.fit.

Run: .venv/bin/python benchmarks/one_rank_overhead.py [--repeats 7] [--out FILE]

One process, one model and data set, three ways interleaved per round: `model.fit`; `hf.fit`
(on one process it delegates to `model.fit`); and the engine, `hf.fit`'s multi-rank path on
this one rank (`hyparflow.api._distributed_fit`: what `hf.fit` runs where it needs it, e.g.
`check_numerics=True` or a checkpoint). Each call trains one epoch after a warm-up call; the
target is the paired ratio of epoch times per round.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement, target  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402

FIGURE = "overhead"
TITLE = "(1) Overhead on one rank: hf.fit and the engine vs model.fit"
WAYS = ("model.fit", "hf.fit", "engine")


def worker(args) -> None:
    import keras

    import hyparflow as hf
    from benchmarks.harness.timing import epoch_timer
    from benchmarks.models import mlp, synthetic_data
    from hyparflow.api import _distributed_fit, _resolve

    keras.config.disable_interactive_logging()
    model = mlp(args.width, args.depth, 784, optimizer="adam", metrics=["accuracy"])
    x, y = synthetic_data(model, args.batch_size * args.steps, seed=0)
    fit = dict(batch_size=args.batch_size, epochs=1, verbose=0)
    resolved = _resolve(model, "data", None, None, None)
    # hf.fit's own defaults, read from its signature; a closed layout: nothing to plan
    names = ("resume", "resume_from", "check_numerics", "check_data", "watchdog_timeout", "comm")
    defaults = inspect.signature(hf.fit).parameters
    options = {name: defaults[name].default for name in names} | {"planning": None}

    def one_epoch(way: str) -> tuple[float, float]:
        timer = epoch_timer()
        if way == "model.fit":
            model.fit(x, y, callbacks=[timer], **fit)
        elif way == "hf.fit":
            hf.fit(model, x, y, callbacks=[timer], **fit)
        else:
            _distributed_fit(
                model, x, y, args.batch_size, 1, resolved, options, verbose=0, callbacks=[timer]
            )
        return timer.seconds[0], timer.cpu_share[0]

    for way in WAYS:  # warm-up: trace, build the engine's Trainer
        one_epoch(way)
    seconds = {way: [] for way in WAYS}
    shares = []
    for round_ in range(args.repeats):
        order = WAYS if round_ % 2 == 0 else WAYS[::-1]
        for way in order:
            wall, share = one_epoch(way)
            seconds[way].append(wall)
            shares.append(share)
    write_result(args.worker_out, 0, {"seconds": seconds, "cpu_share": shares})


def run(args) -> list[dict]:
    shape = ("width", "depth", "batch_size", "steps")
    (result,) = run_worker(__file__, cli.flags(args, "repeats", *shape))
    seconds, base = result["seconds"], result["seconds"]["model.fit"]
    params = {
        **{k: getattr(args, k) for k in shape},
        "min_cpu_share": round(min(result["cpu_share"]), 3),
    }
    records = [
        measurement(FIGURE, f"{way}: s per epoch", seconds[way], "s", **params) for way in WAYS
    ]
    for way, name in (("hf.fit", "hf.fit"), ("engine", "engine on one rank")):
        ratios = paired_ratios(seconds[way], base)
        records.append(target(FIGURE, f"{name} / model.fit", ratios, "<= 1.05"))
    return records


def arguments(argv=None):
    # 15 rounds: the two ways differ by less than one epoch's spread on a shared VM (hf.fit
    # *is* model.fit here); 7 rounds left the paired median anywhere in 0.95-1.05.
    p = cli.parser(__doc__, repeats=15, width=512, depth=3, batch_size=128, steps=50)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.width = 5, 64
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
