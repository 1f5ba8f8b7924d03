"""`benchmarks/results.md`: the machine, the versions, the targets and every figure's records."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.harness.plots import plot_figure

VERSION_KEYS = ("python", "tensorflow", "keras", "mpi4py", "numpy", "horovod")
# the columns of the targets table and of each figure's table
TARGETS = ["figure", "target", "goal", "measured ratio (median)", "range of repeats", "n", "met"]
RECORDS = ["measurement", "median", "range of repeats", "spread (± half-range)", "n", "unit"]


def _number(value: float) -> str:
    magnitude = abs(value)
    if magnitude == 0:
        return "0"
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2e}"


def _range(record: dict) -> str:
    return f"{_number(record['low'])} – {_number(record['high'])}"


def _table(columns: list[str], rows: list[list]) -> list[str]:
    """A markdown table of `rows` under `columns`, then a blank line."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows] + [""]


def machine_section(machine: dict) -> list[str]:
    here = [
        machine.get("cores"),
        machine.get("cpu"),
        f"{machine.get('memory_gib')} GiB",
        machine.get("kernel", ""),
        machine.get("open_mpi"),
    ]
    venvs = [
        [venv, *(versions.get(key) or "–" for key in VERSION_KEYS)]
        for venv, versions in machine.get("venvs", {}).items()
    ]
    return [
        "## Machine",
        "",
        *_table(["cores", "CPU", "RAM", "kernel", "Open MPI"], [here]),
        *_table(["venv", *VERSION_KEYS], venvs),
    ]


def targets_section(figures: list[dict]) -> list[str]:
    targets = [(f["figure"], r) for f in figures for r in f["records"] if r.get("kind") == "target"]
    rows = [
        [
            figure,
            r["name"],
            r["goal"],
            f"{r['median']:.3f}",
            _range(r),
            r["n"],
            "**met**" if r["met"] else "**missed**",
        ]
        for figure, r in targets
    ]
    return ["## Targets", "", *_table(TARGETS, rows)]


def figure_section(figure: dict, plot: str | None, relative_to: Path) -> list[str]:
    lines = [f"## {figure.get('title', figure['figure'])}", ""]
    if figure.get("about"):
        lines += [figure["about"].strip(), ""]
    conditions = figure.get("conditions")
    if conditions:
        lines += ["Conditions: " + ", ".join(f"{k} {v}" for k, v in conditions.items()), ""]
    lines += _table(
        RECORDS,
        [
            [
                r["name"],
                _number(r["median"]),
                _range(r),
                f"{100 * r['spread']:.1f}%",
                r["n"],
                r["unit"],
            ]
            for r in figure["records"]
        ],
    )
    if plot:
        lines += [f"![{figure['figure']}]({os.path.relpath(plot, relative_to)})", ""]
    return lines


def write_results(
    path: str,
    plots_dir: str,
    machine: dict,
    figures: list[dict],
    *,
    preamble: str = "",
    appendix: list = (),
) -> list[str]:
    """Write the results markdown at `path` and one PNG per figure into `plots_dir`.

    `figures`: dicts with `figure` (a short key), `records`, and optionally `title`, `about`
    and `conditions` (load, repeats...). `appendix`: (title, text) pairs shown verbatim, e.g.
    the output of benchmarks that print text. Returns the PNG paths written.
    """
    out = Path(path)
    os.makedirs(plots_dir, exist_ok=True)
    lines = ["# hyparflow benchmark results", ""]
    if preamble:
        lines += [preamble.strip(), ""]
    lines += machine_section(machine)
    lines += targets_section(figures)
    plots = []
    for figure in figures:
        png = os.path.join(plots_dir, f"{figure['figure']}.png")
        plot = plot_figure(figure.get("title", figure["figure"]), figure["records"], png)
        if plot:
            plots.append(plot)
        lines += figure_section(figure, plot, out.parent)
    for title, text in appendix:
        lines += [f"## {title}", "", "```", text.rstrip(), "```", ""]
    out.write_text("\n".join(lines))
    return plots
