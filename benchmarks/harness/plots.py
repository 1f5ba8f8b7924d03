"""One PNG per figure from its records: lines over `x` per series, else bars of medians.

Error bars span each record's lowest and highest repeat. Drawn with matplotlib's Agg canvas
(no pyplot, no display needed).
"""

from __future__ import annotations

from collections import defaultdict


def _canvas(heights: list[float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, sum(heights)), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _height(group: list[dict]) -> float:
    """Inches for a panel: lines get a fixed height, bars grow with their count."""
    if all("x" in r for r in group):
        return 3.5
    return max(2.0, 0.3 * len(group) + 1.0)


def _error(records):
    return [[r["median"] - r["low"] for r in records], [r["high"] - r["median"] for r in records]]


def _draw_lines(axes, records, unit):
    series = defaultdict(list)
    for record in records:
        series[record.get("series", record["name"])].append(record)
    xs = [r["x"] for r in records]
    for label, points in series.items():
        points.sort(key=lambda r: r["x"])
        xs_, medians = [r["x"] for r in points], [r["median"] for r in points]
        axes.errorbar(xs_, medians, yerr=_error(points), marker="o", capsize=3, label=label)
    if min(xs) > 0 and max(xs) / min(xs) >= 8:
        from matplotlib.ticker import FixedLocator, ScalarFormatter

        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_locator(FixedLocator(sorted(set(xs))))
        axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.set_ylabel(unit)
    axes.set_xlabel(next((r["x_label"] for r in records if "x_label" in r), ""))
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)


def _draw_bars(axes, records, unit):
    names = [r["name"] for r in records]
    positions = list(range(len(records)))
    axes.barh(
        positions, [r["median"] for r in records], xerr=_error(records), capsize=3, color="#4c72b0"
    )
    axes.set_yticks(positions, names, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel(unit)
    axes.grid(axis="x", alpha=0.3)
    for record in records:
        if "goal" in record:
            axes.axvline(float(record["goal"].split()[1]), color="red", linestyle="--", lw=1)


def plot_figure(title: str, records: list[dict], path: str) -> str | None:
    """Draw `records` (grouped by unit, one panel each) into the PNG at `path`; None if empty."""
    if not records:
        return None
    by_unit = defaultdict(list)
    for record in records:
        by_unit[record["unit"]].append(record)
    heights = [_height(group) for group in by_unit.values()]
    figure = _canvas(heights)
    grid = figure.add_gridspec(len(heights), 1, height_ratios=heights)
    for row, (unit, group) in enumerate(by_unit.items()):
        axes = figure.add_subplot(grid[row])
        if all("x" in r for r in group):
            _draw_lines(axes, group, unit)
        else:
            _draw_bars(axes, group, unit)
        if row == 0:
            axes.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    return path
