"""`plan --auto --measure`'s pure part: which layouts to train, their rates, the table.

The planner's top layouts (`top`) are each trained for a few steps on the ranks
(`measure_launch` starts them, `measure_worker` trains one); here each outcome is a `Measured`
beside its prediction, printed as a table (`table`) or listed for `--json` (`entries`). No MPI
and no TensorFlow: tested in milliseconds.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from hyparflow.auto.search import Candidate, SearchResult, Verdict
from hyparflow.launch.tensorflow_logs import STARTUP_LOG  # never the reason a run failed

MEASURED = 3  # layouts trained: the pick and the next two
ERROR_CHARS = 300  # of a failed run's error line


@dataclass(frozen=True)
class Measured:
    """A layout, its predicted samples/s, and what its run measured (or why it gave nothing)."""

    candidate: Candidate
    predicted: float
    measured: float | None = None
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        """Measured over predicted samples/s (None without a measurement)."""
        return None if self.measured is None else self.measured / self.predicted


def top(result: SearchResult, count: int = MEASURED) -> list[Verdict]:
    """The `count` fastest layouts that fit, the pick first (rejected ones never run).

    Example:
        >>> from hyparflow.auto.search import Estimate, search
        >>> sizes = {1: 3, 2: 1}  # replicas -> bytes: R1 fits no budget of 2
        >>> layouts = [Candidate(replicas=r, microbatches=m) for r in (1, 2) for m in (1, 2)]
        >>> found = search(layouts, lambda c: Estimate(1 / c.replicas + c.microbatches,
        ...                                            sizes[c.replicas]), 8, budget_bytes=2)
        >>> [v.candidate.label() for v in top(found, 3)]
        ['P1 R2 T1 M1', 'P1 R2 T1 M2']
    """
    return result.ranked[:count]


def median_rate(global_batch: int, step_seconds: list[float]) -> float:
    """Samples/s of the median step: steadier than the mean over a few noisy steps.

    Example:
        >>> median_rate(32, [0.1, 0.2, 5.0])  # one stalled step does not count
        160.0
    """
    return global_batch / statistics.median(step_seconds)


def error_line(text: str) -> str:
    """The line of a failed run's output that says why: hyparflow's own "rank N failed" line,
    else the last `...Error: ...` or `...Exception: ...` line, else the last non-empty one
    that is not TensorFlow's start-up log, cut to `ERROR_CHARS`.

    Example:
        >>> error_line("Traceback ...\\nValueError: no layout\\n--- mpirun noted ---\\n")
        'ValueError: no layout'
    """
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not STARTUP_LOG.match(line)]
    failed = [line for line in lines if re.match(r"hyparflow rank \d+ failed: ", line)]
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b.*:", line)]
    found = (failed[:1] or errors[-1:] or lines[-1:] or ["no output"])[0]
    return found[:ERROR_CHARS]


def fastest(measured: list[Measured]) -> Measured | None:
    """The entry that measured the most samples/s (None if none measured)."""
    ran = [m for m in measured if m.measured is not None]
    return max(ran, key=lambda m: m.measured) if ran else None


def table(measured: list[Measured], steps: int) -> str:
    """Predicted against measured samples/s, one row per layout, and the fastest measured."""
    lines = [
        f"measured ({steps} steps each, median step, synthetic data):",
        f"{'layout':30}{'predicted':>12}{'measured':>12}{'meas/pred':>11}",
    ]
    best = fastest(measured)
    for entry in measured:
        rate = "-" if entry.measured is None else f"{entry.measured:,.0f}"
        ratio = "-" if entry.ratio is None else f"{entry.ratio:.2f}"
        note = f"  failed: {entry.error}" if entry.error else ""
        note += "  <- fastest measured" if entry is best else ""
        lines.append(
            f"{entry.candidate.label():30}{entry.predicted:12,.0f}{rate:>12}{ratio:>11}{note}"
        )
    lines.append(_verdict(measured, best))
    return "\n".join(lines)


def _verdict(measured: list[Measured], best: Measured | None) -> str:
    if best is None:
        return "no layout could be measured"
    pick = measured[0]
    if best is pick:
        return f"the pick, {pick.candidate.label()}, measured fastest"
    against = "failed" if pick.measured is None else f"{pick.measured / best.measured:.2f}x of it"
    return (
        f"{best.candidate.label()} measured fastest; the pick, {pick.candidate.label()}, {against}"
    )


def entries(measured: list[Measured]) -> list[dict]:
    """`--json`'s "measured" list: each layout's hf.Strategy fields and label, its predicted
    samples/s, and its measured samples/s or its error."""
    found = []
    for entry in measured:
        data = {**entry.candidate.strategy_options(), "label": entry.candidate.label()}
        data["predicted_samples_per_second"] = entry.predicted
        if entry.measured is not None:
            data["measured_samples_per_second"] = entry.measured
        else:
            data["error"] = entry.error
        found.append(data)
    return found
