"""The check every multi-rank equivalence test makes, and the fixture that launches its cases.

A scenario trains each case with hf.fit and with Keras's own fit and reports, per rank, measures
of how far hyparflow ended from Keras (relative differences of weights, History, predictions).
`launched` makes a module's fixture that launches the scenario once for all its cases this
session runs; `assert_within` checks each rank's measures against a tolerance and names the
rank and the measure that fails.
"""

from __future__ import annotations

import pytest

from tests.support.cases import run_cases, selected


def launched(scenario: str, np: int, cases: list, *args: str, timeout: float, **launcher):
    """A module-scoped fixture giving each case's id -> its rank results (`run_cases`), for
    `scenario` launched once on `np` ranks with the `cases` this session runs."""

    @pytest.fixture(scope="module")
    def fixture(request):
        chosen = selected(request, cases)
        return run_cases(scenario, np, chosen, *args, timeout=timeout, **launcher)

    return fixture


def assert_within(ranks: list, tolerance: float, *measures: str, where: str = "") -> None:
    """Every rank's `measures` (its result's keys) below `tolerance`."""
    for r in ranks:
        for measure in measures:
            value = r[measure]
            assert value < tolerance, (
                f"{where}rank {r['rank']}: {measure} differs from Keras by {value:.2e}"
            )
