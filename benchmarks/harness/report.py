"""`benchmarks/results.md`: the machine, the versions, the targets and every figure's records."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.harness.plots import plot_figure

VERSION_KEYS = ("python", "tensorflow", "keras", "mpi4py", "numpy", "horovod")


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


def machine_section(machine: dict) -> list[str]:
    lines = [
        "## Machine",
        "",
        "| cores | CPU | RAM | kernel | Open MPI |",
        "|---|---|---|---|---|",
        f"| {machine.get('cores')} | {machine.get('cpu')} | {machine.get('memory_gib')} GiB | "
        f"{machine.get('kernel', '')} | {machine.get('open_mpi')} |",
        "",
        "| venv | " + " | ".join(VERSION_KEYS) + " |",
        "|---|" + "---|" * len(VERSION_KEYS),
    ]
    for venv, versions in machine.get("venvs", {}).items():
        cells = [str(versions.get(key) or "–") for key in VERSION_KEYS]
        lines.append(f"| {venv} | " + " | ".join(cells) + " |")
    return lines + [""]


def targets_section(figures: list[dict]) -> list[str]:
    lines = [
        "## Targets",
        "",
        "| figure | target | goal | measured ratio (median) | range of repeats | n | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for figure in figures:
        for record in figure["records"]:
            if record.get("kind") != "target":
                continue
            met = "**met**" if record["met"] else "**missed**"
            lines.append(
                f"| {figure['figure']} | {record['name']} | {record['goal']} | "
                f"{record['median']:.3f} | {_range(record)} | {record['n']} | {met} |"
            )
    return lines + [""]


def figure_section(figure: dict, plot: str | None, relative_to: Path) -> list[str]:
    lines = [f"## {figure.get('title', figure['figure'])}", ""]
    if figure.get("about"):
        lines += [figure["about"].strip(), ""]
    conditions = figure.get("conditions")
    if conditions:
        lines += ["Conditions: " + ", ".join(f"{k} {v}" for k, v in conditions.items()), ""]
    lines += [
        "| measurement | median | range of repeats | spread (± half-range) | n | unit |",
        "|---|---|---|---|---|---|",
    ]
    for record in figure["records"]:
        lines.append(
            f"| {record['name']} | {_number(record['median'])} | {_range(record)} | "
            f"{100 * record['spread']:.1f}% | {record['n']} | {record['unit']} |"
        )
    lines.append("")
    if plot:
        lines += [f"![{figure['figure']}]({os.path.relpath(plot, relative_to)})", ""]
    return lines


def write_results(path: str, plots_dir: str, machine: dict, figures: list[dict], *,
                  preamble: str = "", appendix: list = ()) -> list[str]:  # fmt: skip
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
