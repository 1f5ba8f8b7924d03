"""A PNG Gantt chart of the pipeline from a `timeline.json` trace: one row per rank."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
from matplotlib.patches import Patch

from hyparflow.callbacks.timeline import IDLE, STEP, read_tracks
from hyparflow.engine import events

GANTT_FILE = "timeline.png"
MAX_STEPS = 3  # more steps make each micro-batch too thin to read

# Compute in cool colours, waiting in warm ones, so the bubble stands out.
COLORS = {
    events.FORWARD: "#4C72B0",
    events.BACKWARD: "#55A868",
    events.WEIGHT: "#64B5CD",
    events.RECV: "#C44E52",
    events.SEND: "#DD8452",
    events.ALLREDUCE: "#8172B3",
    events.OPTIMIZER: "#937860",
    events.TENSOR: "#DA8BC3",
    events.EXPERTS: "#8C613C",
    events.GATHER: "#4C9F70",
}
IDLE_COLOR = "#E6E6E6"
LEGEND_NAMES = {events.RECV: "recv (waiting)"}
LABELLED = events.COMPUTE  # bars that show their micro-batch number
MICROBATCH_LABEL = {"ha": "center", "va": "center", "fontsize": 7, "color": "white", "zorder": 5}
# Tensor collectives run inside a forward or backward: thinner bars drawn over them.
INNER = events.INNER


def chosen_steps(trace: dict, steps: Sequence[int] | None, max_steps: int = MAX_STEPS) -> list:
    """The steps to draw: `steps` if given, else the trace's first `max_steps` steps."""
    present = sorted({s.step for t in read_tracks(trace) for s in t.slices if s.kind == STEP})
    if steps is None:
        return present[:max_steps]
    missing = sorted(set(steps) - set(present))
    if missing:
        raise ValueError(f"steps {missing} are not in the timeline; it holds steps {present}")
    return sorted(steps)


def draw(trace: dict, path: str, steps: Sequence[int] | None = None, title: str | None = None):
    """Draw `steps` of `trace` (default: its first three) as a Gantt chart PNG at `path`.

    For example:
        draw(timeline.load("logs/timeline.json"), "logs/timeline.png", steps=[4, 5])
    """

    tracks = read_tracks(trace)
    wanted = set(chosen_steps(trace, steps))
    if not tracks or not wanted:
        raise ValueError("the timeline has no recorded steps to draw")
    shown = [[s for s in t.slices if s.step in wanted and s.kind != IDLE] for t in tracks]
    origin = min(s.start_ms for row in shown for s in row)
    end = max(s.start_ms + s.duration_ms for row in shown for s in row)
    span_ms = max(end - origin, 1e-9)

    figure = Figure(figsize=(13, 1.6 + 0.75 * len(tracks)), dpi=110)
    axes = figure.add_subplot()
    kinds_seen = set()
    for row, slices in enumerate(shown):
        y = len(tracks) - 1 - row  # first rank on top
        kinds_seen |= _draw_row(axes, slices, y, origin, span_ms, label_steps=row == 0)
    axes.set_yticks(range(len(tracks)))
    axes.set_yticklabels([t.label for t in reversed(tracks)], fontsize=9)
    axes.set_ylim(-0.7, len(tracks) - 0.2)
    axes.set_xlim(-0.01 * span_ms, 1.01 * span_ms)
    axes.set_xlabel("time (ms)")
    axes.grid(axis="x", color="#DDDDDD", linewidth=0.5, zorder=0)
    axes.set_axisbelow(True)
    axes.set_title(title or default_title(trace, sorted(wanted)), fontsize=11)
    handles = [
        Patch(facecolor=COLORS[k], label=LEGEND_NAMES.get(k, k)) for k in COLORS if k in kinds_seen
    ]
    handles.append(Patch(facecolor=IDLE_COLOR, edgecolor="#888888", label="idle"))
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9)
    figure.tight_layout(rect=(0, 0.4 / figure.get_figheight(), 1, 1))  # room for the legend
    figure.savefig(path)
    return path


def _draw_row(axes, slices, y: float, origin: float, span_ms: float, label_steps: bool) -> set:
    """One rank's bars at height `y` (the first row also names the steps); the kinds drawn."""
    kinds = set()
    for s in slices:
        x = s.start_ms - origin
        if s.kind == STEP:
            _draw_step(axes, s, x, y, label_steps)
        else:
            kinds.add(s.kind)
            _draw_work(axes, s, x, y, span_ms)
    return kinds


def _draw_step(axes, s, x: float, y: float, labelled: bool) -> None:
    """The step's extent, under the work bars: the parts of it they leave uncovered are idle."""
    axes.broken_barh(
        [(x, s.duration_ms)],
        (y - 0.4, 0.8),
        facecolor=IDLE_COLOR,
        edgecolor="#888888",
        linewidth=0.8,
        zorder=1,
    )
    if labelled:
        axes.text(x, y + 0.45, f"step {s.step}", fontsize=8, color="#555555", va="bottom")


def _draw_work(axes, s, x: float, y: float, span_ms: float) -> None:
    """One slice of work; a compute bar wide enough to read shows its micro-batch."""
    half, layer = (0.15, 4) if s.kind in INNER else (0.3, 2)
    axes.broken_barh(
        [(x, s.duration_ms)],
        (y - half, 2 * half),
        facecolor=COLORS.get(s.kind, "#333333"),
        edgecolor="white",
        linewidth=0.3,
        zorder=layer,
    )
    if s.kind in LABELLED and s.microbatch is not None and s.duration_ms > span_ms / 90:
        axes.text(x + s.duration_ms / 2, y, str(s.microbatch), **MICROBATCH_LABEL)


def default_title(trace: dict, steps: Sequence[int]) -> str:
    """e.g. "Pipeline timeline: 2 stages x 1 replica, 4 micro-batches (gpipe), steps 1-3"."""
    layout = trace.get("otherData", {}).get("hyparflow", {}).get("layout", {})
    parts = []
    if "stages" in layout and "replicas" in layout:
        parts.append(
            f"{layout['stages']} stage{'s' * (layout['stages'] != 1)} × "
            f"{layout['replicas']} replica{'s' * (layout['replicas'] != 1)}"
        )
    if "microbatches" in layout:
        schedule = f" ({layout['schedule']})" if "schedule" in layout else ""
        parts.append(f"{layout['microbatches']} micro-batches{schedule}")
    which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]}"
    return "Pipeline timeline: " + ", ".join([*parts, which])
