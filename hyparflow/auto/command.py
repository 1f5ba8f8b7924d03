"""`hyparflow plan --auto` (and `simulate --auto N`): the planner's pick for N ranks, its
rivals, and why each lost."""

from __future__ import annotations

import argparse
import collections
import json
import sys

from hyparflow.auto import measure_launch
from hyparflow.auto.estimate import Estimator
from hyparflow.auto.measure import entries, table
from hyparflow.auto.network_default import assumed_network, network_given
from hyparflow.auto.search import Candidate, SearchResult, candidates, rate_text, search, size_text
from hyparflow.simulate import command as simulate_command
from hyparflow.simulate.predict import Machine
from hyparflow.units import byte_size

SHOWN = 10  # ranked layouts printed


def add_arguments(parser) -> None:
    """`--auto` and `--memory`, added to `hyparflow simulate`'s options."""
    auto = parser.add_argument_group("the planner (docs/simulate.md)").add_argument
    auto(
        "--auto",
        type=int,
        metavar="RANKS",
        help="search every layout of RANKS ranks (P x R x "
        "T, micro-batches, schedule, recompute, ZeRO-1) and print the fastest that fits",
    )
    auto(
        "--memory",
        type=byte_size,
        metavar="SIZE",
        help="with --auto: the budget per rank, e.g. 16GiB (needs the model, for its memory plan)",
    )


NETWORK_TITLE = (
    "network (optional: without these, this machine's is measured and nodes are assumed "
    "linked at 2 us, 12 GB/s, as stderr says)"
)

BUILD_LINES = {
    "scope": "memory: counted for a model built under hf.scope() (each rank allocates only its "
    "share); --build ordinary counts one built outside it (every rank also holds it whole)",
    "ordinary": "memory: counted for a model built outside hf.scope() (every rank holds it whole "
    "besides its share); --build scope counts one built under it (each rank allocates its share)",
}

# simulate's options that fix one layout; the planner searches them
FIXED_LAYOUT = {
    "partitions",
    "replicas",
    "microbatches",
    "schedule",
    "virtual_stages",
    "baseline",
    "batch_logs",
}


def plan_parser() -> argparse.ArgumentParser:
    """`hyparflow plan --auto SOURCE --ranks N --batch B [--memory SIZE] [--nodes K ...]`."""
    parser = argparse.ArgumentParser(
        prog="hyparflow plan --auto",
        description="Search every layout of N ranks for a model (timed here) or a costs file, "
        "priced by the scaling model and, with a model, its memory plan; print the fastest "
        "that fits, its rivals, and why the others lost (docs/auto.md).",
    )
    simulate_command.add_arguments(parser, hidden=FIXED_LAYOUT, network_title=NETWORK_TITLE)
    parser.add_argument("--auto", action="store_true", required=True, help="search layouts")
    parser.add_argument("--ranks", type=int, required=True, help="the world size N")
    parser.set_defaults(profile_batch_sizes=None)  # default: one rank's share, and a quarter
    parser.add_argument(
        "--memory",
        type=byte_size,
        metavar="SIZE",
        help="the budget per rank, e.g. 16GiB (needs the model)",
    )
    parser.add_argument(
        "--build",
        choices=("scope", "ordinary"),
        help="how hf.fit's model will be built, for the memory side: under hf.scope() (each "
        "rank allocates its share) or outside it (every rank holds the whole model too); "
        "default: the model's own build, and scope for a saved file (read here without its "
        "weights); the output says which",
    )
    measure = parser.add_argument_group("measuring the top layouts (docs/auto.md)").add_argument
    measure(
        "--measure",
        action="store_true",
        help="train the 3 fastest layouts that fit here, "
        "each on N ranks as `hyparflow run` starts them, on synthetic data, and print "
        "their measured samples/s beside the predicted (needs the model)",
    )
    measure(
        "--measure-steps",
        type=int,
        default=5,
        metavar="K",
        help="timed steps per layout, after 2 warm-up steps (default 5)",
    )
    measure(
        "--measure-timeout",
        type=float,
        default=300,
        metavar="SECONDS",
        help="the limit of each layout's run (default 300)",
    )
    return parser


def plan(argv, memory_of, launch_facts) -> int:
    """`hyparflow plan --auto ...`: `run` with `--ranks` as the world size; with `--measure`,
    the top layouts trained too, each on the ranks `launch_facts()` (the facts `hyparflow
    run` reads, which the CLI passes in) lets it start."""
    parser = plan_parser()
    args = parser.parse_args(argv)
    args.auto = args.ranks
    if args.profile_batch_sizes is None:  # the micro-batches the layouts run, as hf.fit times
        from hyparflow.auto.choose import timing_batches

        args.profile_batch_sizes = list(timing_batches(args.batch_size, args.ranks))
    if not args.measure:
        return run(args, memory_of, name=parser.prog)
    if args.measure_steps < 1:
        parser.error(f"--measure-steps {args.measure_steps}: time at least 1 step")
    if args.source.endswith(".json"):
        print(
            f"{parser.prog}: --measure trains the model, and a costs file has none to train: "
            "give MODEL (a .keras file or module:function)",
            file=sys.stderr,
        )
        return 1

    def measure(result):
        return _measured(result, args, launch_facts())

    return run(args, memory_of, measure=measure, name=parser.prog)


def _measured(result: SearchResult, args, facts) -> list:
    return measure_launch.measure(
        result, args, facts, say=lambda text: print(text, file=sys.stderr)
    )


def run(args, memory_of, measure=None, name="hyparflow simulate") -> int:
    """Search every layout of `args.auto` ranks; print the pick (or JSON); 1 if none fits.
    `memory_of(model, batch_size)` gives a function of a layout's bytes per rank (hyparflow's
    memory plan, which the CLI passes in); `measure(result)`, if given, trains the top
    layouts and returns their `auto.measure.Measured`, printed after the report. `name`: the
    command the user typed, which errors begin with."""
    try:
        network = _network(args)
        costs, model = _costs_of(args)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"{name}: {error}", file=sys.stderr)
        return 1
    if model is not None:  # timed here: the tensor shares and host costs too
        costs = _with_planner_costs(costs, model, args)
    machine = Machine(args.cores_per_node or costs.measured.get("cores"), args.jitter)
    memory = None if model is None else memory_of(model, args.batch_size, _whole_model(model, args))
    budget = args.memory
    if budget is not None and memory is None:
        print(
            f"{name}: --memory needs the model (a .keras file or module:function) "
            "for its memory plan, not a costs file",
            file=sys.stderr,
        )
        return 1
    per_node = args.ranks_per_node or (-(-args.auto // args.nodes) if args.nodes else None)
    estimate = Estimator(
        costs, network, args.batch_size, machine=machine, memory=memory, ranks_per_node=per_node
    )
    layouts = candidates(args.auto, args.batch_size, layers=len(costs.layers))
    try:
        result = search(layouts, estimate, args.batch_size, budget, bound=estimate.bound)
    except ValueError as error:
        print(f"{name}: {error}", file=sys.stderr)
        return 1
    _print(result, args, None if measure is None else measure(result))
    return 0


def _costs_of(args):
    """(costs, model): a costs file's (no model), or the model's timed here: layer by layer
    (`simulate/by_layer.py`) where it holds no weights (a saved file, read without them, or a
    build under hf.scope()), else whole (`simulate/measure.py`), as `hyparflow simulate` does."""
    if args.source.endswith(".json"):
        return simulate_command.costs_of(args)
    from hyparflow.deferred import any_deferred  # imports Keras: only with a model
    from hyparflow.partitioner.source import load_architecture

    model = load_architecture(args.source, args.custom_objects)
    if any_deferred(model):
        from hyparflow.simulate.by_layer import measure_by_layer

        return simulate_command.model_costs(model, args, measure_by_layer), model
    from hyparflow.simulate.measure import measure_model

    return simulate_command.model_costs(model, args, measure_model), model


def _whole_model(model, args) -> bool:
    """Whether each rank's memory counts the whole model besides its share (`--build
    ordinary`) or only its share (`--build scope`); the default is the model's own build (a
    saved file counts as rebuilt under hf.scope()), said on stderr."""
    from hyparflow.deferred import any_deferred

    build = getattr(args, "build", None) or ("scope" if any_deferred(model) else "ordinary")
    print(BUILD_LINES[build], file=sys.stderr)
    return build == "ordinary"


def _network(args):
    """The network the command line gives, or (said on stderr) this machine's measured with
    a default between nodes (`network_default.py`)."""
    if network_given(args):
        return simulate_command.network_of(args)
    network, line = assumed_network()
    print(line, file=sys.stderr)
    if args.save_network:
        with open(args.save_network, "w") as f:
            json.dump(network.to_dict(), f, indent=1)
    return network


def _print(result: SearchResult, args, measured: list | None) -> None:
    """The report, or `--json`'s object; with `measured`, its table or "measured" list."""
    if args.json:
        found = to_dict(result)
        if measured is not None:
            found["measured"] = entries(measured)
        print(json.dumps(found, indent=1))
    elif measured is None:
        print(report(result))
    else:
        print(f"{report(result)}\n\n{table(measured, args.measure_steps)}")


def _with_planner_costs(costs, model, args):
    """`costs` of `model` with what the planner times besides (saved, if asked, with them)."""
    from hyparflow.auto.choose import least_factor
    from hyparflow.auto.planner_costs import with_planner_costs  # imports TensorFlow

    small = min(args.profile_batch_sizes)
    costs = with_planner_costs(costs, model, small, args.input_shape, least_factor(args.auto))
    if args.save_costs:
        costs.save(args.save_costs)
    return costs


def report(result: SearchResult) -> str:
    """The pick's line, the fastest layouts with their step, rate and bytes, and the
    rejected ones counted by reason."""
    lines = [result.line(), _against_data_parallel(result), ""]
    lines.append(f"{'layout':30}{'step ms':>10}{'samples/s':>12}{'GiB/rank':>10}")
    for verdict in result.ranked[:SHOWN]:
        guess, rate = verdict.estimate, rate_text(result.samples_per_second(verdict))
        lines.append(
            f"{verdict.candidate.label():30}{guess.step_seconds * 1e3:10.2f}"
            f"{rate:>12}{guess.bytes_per_rank / 2**30:10.2f}"
            f"  {verdict.reason or 'the pick'}"
        )
    if len(result.ranked) > SHOWN:
        lines.append(f"... and {len(result.ranked) - SHOWN} slower layouts")
    sized = [v.estimate.bytes_per_rank for v in result.rejected if v.estimate is not None]
    if sized:  # over the budget: one line, not one per size
        low, high = size_text(min(sized)), size_text(max(sized))
        lines.append(f"rejected {len(sized)}: over the budget per rank (they need {low} to {high})")
    reasons = collections.Counter(v.reason for v in result.rejected if v.estimate is None)
    lines += [f"rejected {count}: {reason}" for reason, count in sorted(reasons.items())]
    return "\n".join(lines)


def data_parallel(result: SearchResult):
    """Plain data parallelism (every rank a replica, one micro-batch, no ZeRO) if it fits,
    else the fastest fitting layout without stages or tensor ranks, or None."""
    plain = [v for v in result.ranked if v.candidate.partitions == v.candidate.tensor == 1]
    simplest = [v for v in plain if v.candidate.simplicity() == Candidate().simplicity()]
    return (simplest or plain or [None])[0]


def _against_data_parallel(result: SearchResult) -> str:
    plain = data_parallel(result)
    if plain is None:
        return "data parallelism: no layout of it fits or runs"
    speedup = result.speedup(plain)
    rate = result.samples_per_second(plain)
    label = plain.candidate.label()
    return f"data parallelism: {label} at {rate_text(rate)} samples/s; pick {speedup:.2f}x"


def to_dict(result: SearchResult) -> dict:
    """`--json`: the pick (hf.Strategy's options, predicted rate and bytes), every ranked
    layout, and every rejected one with its reason."""

    def entry(verdict) -> dict:
        data = {**verdict.candidate.strategy_options(), "label": verdict.candidate.label()}
        if verdict.estimate is not None:
            data["step_seconds"] = verdict.estimate.step_seconds
            data["samples_per_second"] = result.samples_per_second(verdict)
            data["memory_per_rank_bytes"] = verdict.estimate.bytes_per_rank
        return {**data, "reason": verdict.reason}

    plain = data_parallel(result)
    return {
        "pick": entry(result.pick),
        "data_parallel": None if plain is None else entry(plain),
        "speedup_over_data_parallel": None if plain is None else result.speedup(plain),
        "ranked": [entry(v) for v in result.ranked],
        "rejected": [entry(v) for v in result.rejected],
    }
