"""strategy="auto" against every layout of 2 ranks, measured in the same launch (issue #41).

Run: .venv/bin/python benchmarks/auto_choice.py [--repeats 3] [--steps 5] (starts mpirun)

The MLP and the transformer block of figure "tensor" (tensor_parallel.py, Adam), which the
tests did not tune the planner for; one launch of 2 ranks per model, a fresh model per setup:
`hf.Strategy("auto")` and every layout of 2 ranks, named as the planner names them: data
parallel R2, also with ZeRO-1 ("zero"), tensor T2, and 2-stage pipelines (GPipe, 1F1B,
zero_bubble, interleaved) of 1, 2, 4, 8 micro-batches; every strategy `tune_process=True`.
A layout that hf.Strategy or a first one-step hf.fit refuses (ValueError) is left out, and a
row counts and names those. Epochs interleaved (a warm-up epoch each, auto's with its planning,
then rounds of one epoch each, the order rotated); samples/s = global batch x steps / epoch
seconds. Target: auto / the best other setup (highest median samples/s), paired per round,
>= 0.9. Predicted: the samples/s the planner's search gave auto's pick and each layout it
scored (layouts it left unscored or never considered have none).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement, target  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402
from benchmarks.tensor_parallel import QUICK, SIZES, _model  # noqa: E402

FIGURE, TITLE = "auto", 'strategy="auto" against every layout of 2 ranks, measured'
SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved")


def layouts(microbatches: list[int]) -> dict:
    """The planner's label -> `hf.Strategy` arguments, for every layout of 2 ranks."""
    from hyparflow.auto.search import Candidate

    whole = [Candidate(replicas=2, shard_optimizer=zero) for zero in (False, True)]
    pipelines = [Candidate(2, microbatches=m, schedule=s) for s in SCHEDULES for m in microbatches]
    return {c.label(): c.strategy_options() for c in [*whole, Candidate(tensor=2), *pipelines]}


def worker(args) -> None:
    import hyparflow as hf
    from benchmarks.harness.timing import interleaved_epochs
    from benchmarks.models import synthetic_data

    size = (QUICK if args.quick else SIZES)[args.model]
    batch = size["batch"]
    setups = {"auto": (_model(size), hf.Strategy("auto", tune_process=True))}
    x, y = synthetic_data(setups["auto"][0], batch * args.steps)
    refused = {}
    for label, options in layouts(args.microbatches).items():
        model = _model(size)
        try:  # refused here, or traced: the warm-up epoch below is then its second
            strategy = hf.Strategy(**options, tune_process=True)
            hf.fit(model, x, y, batch_size=batch, steps_per_epoch=1, verbose=0, strategy=strategy)
            setups[label] = (model, strategy)
        except ValueError as error:
            refused[label] = str(error)
    seconds = interleaved_epochs(setups, x, y, batch, args.repeats, steps=args.steps)
    if hf.rank() == 0:
        rates = {name: [batch * args.steps / s for s in v] for name, v in seconds.items()}
        write_result(
            args.worker_out, 0, {"rates": rates, "refused": refused, **_planned(setups["auto"][0])}
        )


def _planned(model) -> dict:
    """Auto's pick for `model` on 2 ranks, and the samples/s its search predicted per layout."""
    from hyparflow.auto.choose import last_choice

    choice = last_choice(model, 2)
    if choice is None:  # not planned: data parallel (the planner could not time the model)
        return {"pick": None, "predicted": {}}
    result = choice.result
    scored = [v for v in result.ranked + result.rejected if v.estimate is not None]
    predicted = {v.candidate.label(): result.samples_per_second(v) for v in scored}
    return {
        "pick": result.pick.candidate.label(),
        "predicted": predicted,
        "planning_s": sum(choice.seconds.values()),
    }


def _records(name: str, r: dict) -> list[dict]:
    rates, pick = r["rates"], r["pick"]
    predicted = {**r["predicted"], "auto": r["predicted"].get(pick)}
    shown = {"auto": f"auto ({pick or 'not planned'})"}
    best = max((k for k in rates if k != "auto"), key=lambda k: statistics.median(rates[k]))
    ratios = paired_ratios(rates["auto"], rates[best])
    records = [target(FIGURE, f"{name}: auto / best measured ({best})", ratios, ">= 0.9")]
    records += [
        measurement(FIGURE, f"{name}: {shown.get(k, k)}, samples/s", v, "samples/s")
        for k, v in rates.items()
    ]
    records += [
        measurement(
            FIGURE,
            f"{name}: {shown.get(k, k)}, predicted samples/s",
            [predicted[k]],
            "predicted samples/s",
        )
        for k in rates
        if predicted.get(k) is not None
    ]
    if "planning_s" in r:
        records.append(measurement(FIGURE, f"{name}: auto's planning", [r["planning_s"]], "s"))
    if r["refused"]:
        refused = f"{name}: layouts refused up front ({', '.join(r['refused'])})"
        records.append(measurement(FIGURE, refused, [len(r["refused"])], "layouts"))
    return records


def run(args) -> list[dict]:
    records = []
    for name in SIZES:
        flags = ["--model", name, "--microbatches", *args.microbatches]
        flags += cli.flags(args, "repeats", "steps") + ["--quick"] * args.quick
        r = run_worker(__file__, flags, np=2)[0]
        for label, reason in r["refused"].items():
            print(f"{name}: {label} refused: {reason}", file=sys.stderr)
        records += _records(name, r)
    return records


def arguments(argv=None):
    p = cli.parser(__doc__, repeats=3, steps=5)
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--model", choices=sorted(SIZES), help="worker: which model")
    args = p.parse_args(argv)
    if args.quick:
        args.microbatches = [1, 4]
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
