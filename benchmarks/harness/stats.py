"""Median and spread of repeated measurements, and ratios of interleaved A/B pairs."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def summarize(values: Sequence[float]) -> dict:
    """Median, extremes and relative half-range of `values` (the spread we report).

    Example:
        >>> summarize([1.0, 2.0, 4.0])["median"], summarize([1.0, 2.0, 4.0])["spread"]
        (2.0, 0.75)
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("summarize needs at least one value")
    median = statistics.median(values)
    low, high = min(values), max(values)
    spread = (high - low) / (2 * abs(median)) if median else 0.0
    return {
        "median": median,
        "low": low,
        "high": high,
        "spread": spread,
        "n": len(values),
        "values": values,
    }


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Ratio of each interleaved pair: drift of a shared machine hits both sides of a pair alike.

    Example:
        >>> paired_ratios([2.0, 3.0], [1.0, 2.0])
        [2.0, 1.5]
    """
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators but {len(denominators)} denominators")
    return [a / b for a, b in zip(numerators, denominators, strict=True)]
