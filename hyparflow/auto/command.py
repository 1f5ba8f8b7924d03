"""`hyparflow simulate --auto N`: the planner's pick for N ranks, its rivals, and why each lost."""

from __future__ import annotations

import collections
import json
import re
import sys

from hyparflow.auto.estimate import estimator
from hyparflow.auto.search import SearchResult, candidates, search
from hyparflow.simulate import command as simulate_command
from hyparflow.simulate.predict import Machine

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
SHOWN = 10  # ranked layouts printed


def byte_size(text: str) -> int:
    """Bytes in `text`, e.g. "16GiB", "1.5 GB", "4096".

    >>> byte_size("16GiB"), byte_size("1.5 GB"), byte_size("4096")
    (17179869184, 1500000000, 4096)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in UNITS:
        raise ValueError(f"{text!r} is not a size: write e.g. 16GiB, 1.5GB or 4096")
    return int(float(match.group(1)) * UNITS[unit])


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
    auto("--memory", type=byte_size, metavar="SIZE", help="with --auto: the budget per rank, "
         "e.g. 16GiB (needs the model, for its memory plan)")  # fmt: skip


def run(args, memory_of) -> int:
    """Search every layout of `args.auto` ranks; print the pick (or JSON); 1 if none fits.
    `memory_of(model, batch_size)` gives a function of a layout's bytes per rank (hyparflow's
    memory plan, which the CLI passes in)."""
    try:
        (costs, model), network = simulate_command.costs_of(args), simulate_command.network_of(args)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"hyparflow simulate: {error}", file=sys.stderr)
        return 1
    machine = Machine(args.cores_per_node or costs.measured.get("cores"), args.jitter)
    memory = None if model is None else memory_of(model, args.batch_size)
    budget = args.memory
    if budget is not None and memory is None:
        print("hyparflow simulate: --memory needs the model (a .keras file or module:function) "
              "for its memory plan, not a costs file", file=sys.stderr)  # fmt: skip
        return 1
    estimate = estimator(
        costs, network, args.batch_size, machine=machine, memory=memory,
        ranks_per_node=args.ranks_per_node,
    )  # fmt: skip
    layouts = candidates(args.auto, args.batch_size, layers=len(costs.layers))
    try:
        result = search(layouts, estimate, args.batch_size, budget_bytes=budget)
    except ValueError as error:
        print(f"hyparflow simulate: {error}", file=sys.stderr)
        return 1
    print(json.dumps(to_dict(result), indent=1) if args.json else report(result))
    return 0


def report(result: SearchResult) -> str:
    """The pick's line, the fastest layouts with their step, rate and bytes, and the
    rejected ones counted by reason."""
    lines = [result.line(), "", f"{'layout':30}{'step ms':>10}{'samples/s':>12}{'GiB/rank':>10}"]
    for verdict in result.ranked[:SHOWN]:
        guess = verdict.estimate
        lines.append(
            f"{verdict.candidate.label():30}{guess.step_seconds * 1e3:10.2f}"
            f"{result.samples_per_second(verdict):12,.0f}{guess.bytes_per_rank / 2**30:10.2f}"
            f"  {verdict.reason or 'the pick'}"
        )
    if len(result.ranked) > SHOWN:
        lines.append(f"... and {len(result.ranked) - SHOWN} slower layouts")
    reasons = collections.Counter(verdict.reason for verdict in result.rejected)
    lines += [f"rejected {count}: {reason}" for reason, count in sorted(reasons.items())]
    return "\n".join(lines)


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

    return {
        "pick": entry(result.pick),
        "ranked": [entry(v) for v in result.ranked],
        "rejected": [entry(v) for v in result.rejected],
    }
