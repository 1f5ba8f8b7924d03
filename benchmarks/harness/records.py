"""The JSON records every benchmark prints and returns: measurements and targets."""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence

from benchmarks.harness.stats import summarize

GOALS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def measurement(
    figure: str,
    name: str,
    values: Sequence[float],
    unit: str,
    *,
    series: str | None = None,
    x: float | None = None,
    x_label: str | None = None,
    **params,
) -> dict:
    """One measured quantity over repeats; `series` and `x` (named `x_label`) place it on a line
    plot.

    Example:
        >>> measurement("p2p", "raw 4 MiB", [10.0, 12.0], "GB/s", series="raw", x=4)["median"]
        11.0
    """
    record = {"figure": figure, "name": name, "unit": unit, **summarize(values)}
    placed = {"series": series, "x": x, "x_label": x_label}
    record.update({key: value for key, value in placed.items() if value is not None})
    if params:
        record["params"] = params
    return record


def target(figure: str, name: str, ratios: Sequence[float], goal: str, **params) -> dict:
    """A ratio against a goal such as "<= 1.05": met when the median ratio satisfies it.

    Example:
        >>> target("overhead", "hf.fit / model.fit", [1.01, 1.02, 0.99], "<= 1.05")["met"]
        True
    """
    op, bound = goal.split()
    record = {"figure": figure, "name": name, "unit": "ratio", "goal": goal, **summarize(ratios)}
    record["met"] = bool(GOALS[op](record["median"], float(bound)))
    record["kind"] = "target"
    if params:
        record["params"] = params
    return record


def emit(records: list[dict], out: str | None = None) -> list[dict]:
    """Print the records as JSON (one per line) and write them to `out` if given."""
    for record in records:
        print(json.dumps(record), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(records, f, indent=1)
    return records
