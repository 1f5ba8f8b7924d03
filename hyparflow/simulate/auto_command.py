"""`hyparflow simulate --auto N`: the planner's pick for N ranks, its rivals, and why each lost."""

from __future__ import annotations

import functools
import json
import re
import sys

from hyparflow.simulate.auto import estimator
from hyparflow.simulate.search import Candidate, SearchResult, candidates, search

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


def memory_of(model, batch_size: int):
    """A candidate's peak bytes on its fullest rank, by hyparflow's memory plan of `model`."""
    from hyparflow.memory import memory_plan  # imports Keras: only with a model
    from hyparflow.strategy import Strategy

    @functools.cache
    def memory(candidate: Candidate) -> int:
        strategy = Strategy(**candidate.strategy_options())
        return memory_plan(model, strategy, batch_size=batch_size).largest.total

    return memory


def run(args, costs, network, machine, model) -> int:
    """Search every layout of `args.auto` ranks; print the pick (or JSON); 1 if none fits."""
    budget = args.memory
    if budget is not None and model is None:
        print("hyparflow simulate: --memory needs the model (a .keras file or module:function) "
              "for its memory plan, not a costs file", file=sys.stderr)  # fmt: skip
        return 1
    memory = None if model is None else memory_of(model, args.batch_size)
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
    reasons: dict[str, int] = {}
    for verdict in result.rejected:
        reasons[verdict.reason] = reasons.get(verdict.reason, 0) + 1
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
