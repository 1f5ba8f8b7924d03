"""`hyparflow report LOG_DIR`: a profiled run's per-rank table and bubble/efficiency summary.

It reads `profile.json` (the profiler's own summary: it holds the rank layout, which the
TensorBoard event files do not) and redraws the Gantt chart from `timeline.json`.
"""

from __future__ import annotations

import os

from hyparflow.callbacks import gantt, timeline
from hyparflow.callbacks.summary import SUMMARY_FILE, load_summary

# (header, key in ms_per_step) of the time columns, each shown as "ms (share of the step)".
TIME_COLUMNS = (
    ("compute", "compute"),
    ("p2p wait", "p2p_wait"),
    ("send", "send"),
    ("allreduce", "allreduce"),
    ("optimizer", "optimizer"),
    ("idle", "idle"),
)
# With tensor or expert parallelism their collectives, with ZeRO-3 its gathers of weights, get
# columns after compute (which excludes them).
INNER_COLUMNS = (("tensor", "tensor"), ("experts", "experts"), ("gather", "gather"))
KIND_NAMES = {
    "data": "data parallel",
    "model": "model parallel",
    "hybrid": "hybrid parallel",
    "tensor": "tensor parallel",
}


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _time_cell(ms: dict, key: str) -> str:
    value, step = ms.get(key), ms.get("step")
    if value is None:
        return "-"
    share = f" ({100 * value / step:.0f}%)" if step else ""
    return f"{value:.2f}{share}"


def describe_layout(layout: dict) -> str:
    """e.g. "model parallel, 2 stages x 1 replica, 4 micro-batches (gpipe), 2 ranks"."""
    kind = layout.get("kind")
    if kind == "single process":
        return "single process (plain model.fit: only step times are known)"
    grid = f"{_count(layout.get('stages'), 'stage')} x {_count(layout.get('replicas'), 'replica')}"
    if layout.get("tensor", 1) > 1:
        grid += f" x {_count(layout['tensor'], 'tensor shard')}"
    if layout.get("experts", 1) > 1:
        grid += f", experts split over {layout['experts']} replicas"
    return ", ".join(
        [
            KIND_NAMES.get(kind, str(kind)),
            grid,
            f"{_count(layout.get('microbatches'), 'micro-batch')} ({layout.get('schedule')})",
            _count(layout.get("world_size"), "rank"),
        ]
    )


def _count(n, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "es" if noun.endswith("ch") else "s")


def time_columns(ms: dict) -> tuple:
    """TIME_COLUMNS, with the tensor and experts columns after compute where the run has tensor
    or expert parallelism (its summary has their times)."""
    inner = tuple(column for column in INNER_COLUMNS if column[1] in ms)
    return (TIME_COLUMNS[0], *inner, *TIME_COLUMNS[1:])


def format_report(summary: dict) -> str:
    """The per-rank table and the job's bubble, throughput and efficiency, as text.

    For example:
        print(format_report(load_summary("logs/run1/profile.json")))
    """
    steps = summary["steps"]
    excluded = steps.get("warmup_excluded") or []
    lines = [
        f"Profiled run: {describe_layout(summary['layout'])}",
        f"{steps['summarized']} of {steps['recorded']} steps summarized"
        + (f" (warm-up steps {', '.join(map(str, excluded))} left out)" if excluded else "")
        + "; times are ms per step (share of the step)",
        "",
    ]
    job = summary["job"]
    columns = time_columns(job["ms_per_step"])
    # a node column where the ranks ran on several nodes (older profiles record none)
    nodes = [r.get("node") for r in summary["ranks"]]
    by_node = len(set(nodes)) > 1
    header = [
        "rank",
        *(["node"] if by_node else []),
        "stage",
        "replica",
        "step ms",
        *(h for h, _ in columns),
        "bubble",
        "samples/s",
    ]
    rows = []
    for r, node in zip(summary["ranks"], nodes, strict=True):
        ms = r["ms_per_step"]
        rows.append(
            [
                str(r["rank"]),
                *([str(node)] if by_node else []),
                str(r["stage"]),
                str(r["replica"]),
                _number(ms["step"], 2),
                *(_time_cell(ms, key) for _, key in columns),
                _percent(r["bubble"]),
                _number(r["throughput"]),
            ]
        )
    ms = job["ms_per_step"]
    rows.append(
        [
            "job",
            *([""] if by_node else []),
            "",
            "",
            _number(ms["step"], 2),
            *(_time_cell(ms, key) for _, key in columns),
            _percent(job["bubble_measured"]),
            _number(job["throughput"]),
        ]
    )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    lines.append("")
    lines.extend(_collective_lines(summary["ranks"]))
    lines.append(_bubble_line(job, summary["layout"]))
    lines.append(_throughput_line(summary))
    return "\n".join(lines)


def _collective_lines(ranks: list) -> list[str]:
    """A line per category of in-graph collectives (tensor, experts, ZeRO-3's gathers): calls
    and bytes a rank moved over the fit, and the mean size of one, the busiest rank's; for
    the gathers also how much of their time compute hid."""
    found = ranks[0].get("collectives") or {} if ranks else {}
    lines = []
    for kind in found:
        busiest = max((r["collectives"][kind] for r in ranks), key=lambda c: c["bytes"])
        calls, nbytes = busiest["calls"], busiest["bytes"]
        each = f", {nbytes / calls / 1024:,.1f} KiB each" if calls else ""
        lines.append(
            f"{kind.capitalize()} collectives (busiest rank, whole fit): {calls:,} calls, "
            f"{nbytes / 2**20:,.2f} MiB{each}"
        )
        hidden = busiest.get("hidden")
        if hidden and hidden["share"] is not None:  # ZeRO-3's gathers, run ahead
            lines.append(
                f"  transfers {hidden['ms']:,.1f} ms, steps waited {hidden['waited_ms']:,.1f} ms: "
                f"compute hid {100 * hidden['share']:.0f}% of the gather time"
            )
        phases = busiest.get("phases") or {}
        if phases:  # experts: dispatch, compute, combine
            lines.append("  " + "; ".join(_phase_text(p, v) for p, v in phases.items()))
    return lines


def _phase_text(phase: str, moved: dict) -> str:
    """One phase of the experts' work: its time, and its calls and bytes where it moves any."""
    text = f"{phase} {moved['ms']:,.1f} ms"
    if moved["bytes"]:
        text += f" in {moved['calls']:,} exchanges of {moved['bytes'] / 2**20:,.2f} MiB"
    return text


def _bubble_line(job: dict, layout: dict) -> str:
    measured, formula = job.get("bubble_measured"), job.get("bubble_theoretical")
    if layout.get("stages") == 1:
        idle = "" if measured is None else f"; measured non-compute share: {_percent(measured)}"
        return f"Pipeline bubble: none in theory (one stage){idle}"
    name = {
        "zero_bubble": "ZB-H1 at these F, B, W times",
        "interleaved": f"(p-1)/({layout.get('virtual_stages', 1)}m+p-1)",
    }.get(layout.get("schedule"), "(p-1)/(m+p-1)")
    if measured is None:
        return f"Pipeline bubble: not measured; theoretical {name} = {_percent(formula)}"
    line = (
        f"Pipeline bubble: measured {_percent(measured)} vs theoretical {name} = "
        f"{_percent(formula)}"
    )
    simulated = job.get("bubble_simulated")
    if simulated is not None:
        line += f" (ideal machine with these stage times: {_percent(simulated)})"
    return line


def _throughput_line(summary: dict) -> str:
    job, baseline = summary["job"], summary.get("baseline_throughput")
    line = f"Throughput: {_number(job['throughput'])} samples/s"
    if job.get("efficiency") is not None:
        world = summary["layout"].get("world_size")
        line += (
            f"; scaling efficiency {_percent(job['efficiency'])} of {world} x "
            f"{_number(baseline)} samples/s (baseline: one rank)"
        )
    else:
        line += "; scaling efficiency: pass baseline_throughput= to the profiler to see it"
    return line


def report(log_dir: str, png: str | None = None, steps=None) -> tuple[str, str | None]:
    """The text report of `log_dir` and the Gantt chart PNG written (None without a timeline).

    `png` defaults to `LOG_DIR/timeline.png`; `steps` picks the timeline steps to draw.
    """
    summary_path = os.path.join(log_dir, SUMMARY_FILE)
    if not os.path.exists(summary_path):
        raise FileNotFoundError(
            f"{summary_path} does not exist; point at the log_dir given to ScalingProfiler, "
            "after training ended (the summary is written at the end of fit)."
        )
    text = format_report(load_summary(summary_path))
    trace_path = os.path.join(log_dir, timeline.TIMELINE_FILE)
    if not os.path.exists(trace_path):
        return text, None
    png = png or os.path.join(log_dir, gantt.GANTT_FILE)
    gantt.draw(timeline.load(trace_path), png, steps=steps)
    return text, png
