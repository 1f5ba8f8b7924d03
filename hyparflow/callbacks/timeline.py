"""Recorded steps of every rank as a Chrome trace (`timeline.json`, loads in Perfetto), and back.

Each rank is one track: process id = its pipeline replica, thread id = its rank, so Perfetto
and chrome://tracing show one group per pipeline with one row per stage. Every step is an
enclosing `step N` slice; inside it each span is a slice named `<kind> <micro-batch>` (category
= kind) and every gap of at least `min_idle` between spans is an `idle` slice. Tensor-parallel
collectives (`tensor`) nest inside the forward or backward slice that ran them. Times are
microseconds from the earliest step start, on rank 0's clock (the ranks' offsets, from
`clock.py`, are subtracted before conversion).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hyparflow.engine import events

TIMELINE_FILE = "timeline.json"
IDLE = "idle"
STEP = "step"
MIN_IDLE = 1e-5  # seconds; shorter gaps are Python bookkeeping between spans, not waiting


def aligned(record: events.StepRecord, offset: float) -> events.StepRecord:
    """`record` with `offset` subtracted from every time (this rank's clock to rank 0's)."""
    spans = tuple(replace(s, start=s.start - offset, end=s.end - offset) for s in record.spans)
    return replace(record, start=record.start - offset, end=record.end - offset, spans=spans)


def idle_gaps(record: events.StepRecord, min_idle: float = MIN_IDLE) -> list[tuple[float, float]]:
    """Intervals of the step that no span covers and that last at least `min_idle` seconds.

    Example:
        >>> spans = (events.Span("forward", 0, 0, 1.0, 2.0), events.Span("recv", 0, 1, 3.0, 4.0))
        >>> idle_gaps(events.StepRecord(0, 0.5, 4.0, 8, 2, spans), min_idle=0.1)
        [(0.5, 1.0), (2.0, 3.0)]
    """
    gaps, cursor = [], record.start
    for span in sorted(record.spans, key=lambda s: s.start):
        if span.start - cursor >= min_idle:
            gaps.append((cursor, span.start))
        cursor = max(cursor, span.end)
    if record.end - cursor >= min_idle:
        gaps.append((cursor, record.end))
    return gaps


def span_name(kind: str, microbatch: int | None) -> str:
    return kind if microbatch is None else f"{kind} {microbatch}"


def to_trace(
    tracks: Sequence[tuple[dict, Sequence[events.StepRecord]]],
    layout: dict | None = None,
    min_idle: float = MIN_IDLE,
) -> dict:
    """Chrome trace document for `tracks`: `(info, steps)` per rank, with `info` holding
    `rank`, `stage` and `replica` and the steps already on the common clock.

    Example:
        >>> span = events.Span("forward", 0, 0, 1.0, 1.5)
        >>> trace = to_trace([({"rank": 0, "stage": 0, "replica": 0},
        ...                    [events.StepRecord(0, 1.0, 2.0, 8, 1, (span,))])])
        >>> [(e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"]
        [('step 0', 0.0, 1000000.0), ('forward 0', 0.0, 500000.0), ('idle', 500000.0, 500000.0)]
    """
    starts = [record.start for _, steps in tracks for record in steps]
    origin = min(starts, default=0.0)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    trace_events = []
    replicas = sorted({info["replica"] for info, _ in tracks})
    for q in replicas:
        trace_events.append(_meta("process_name", q, None, {"name": f"pipeline replica {q}"}))
        trace_events.append(_meta("process_sort_index", q, None, {"sort_index": q}))
    for info, steps in tracks:
        rank, stage, q = info["rank"], info["stage"], info["replica"]
        name = f"rank {rank} · stage {stage}" + (f" · {info['node']}" if "node" in info else "")
        trace_events.append(_meta("thread_name", q, rank, {"name": name, **_where(info)}))
        trace_events.append(_meta("thread_sort_index", q, rank, {"sort_index": stage}))
        for record in steps:
            trace_events.append(
                _slice(
                    f"step {record.step}",
                    STEP,
                    q,
                    rank,
                    us(record.start),
                    us(record.end),
                    {
                        "step": record.step,
                        "samples": record.samples,
                        "microbatches": record.microbatches,
                    },
                )
            )
            for span in sorted(record.spans, key=lambda s: s.start):
                trace_events.append(
                    _slice(
                        span_name(span.kind, span.microbatch),
                        span.kind,
                        q,
                        rank,
                        us(span.start),
                        us(span.end),
                        {"step": record.step, "microbatch": span.microbatch},
                    )
                )
            for start, end in idle_gaps(record, min_idle):
                trace_events.append(
                    _slice(IDLE, IDLE, q, rank, us(start), us(end), {"step": record.step})
                )
    return {
        "traceEvents": trace_events,
        "displayTimeUnit": "ms",
        "otherData": {"hyparflow": {"layout": dict(layout or {}), "origin_seconds": origin}},
    }


def _where(info: dict) -> dict:
    where = {"rank": info["rank"], "stage": info["stage"], "replica": info["replica"]}
    return {**where, "node": info["node"]} if "node" in info else where


def _meta(name: str, pid: int, tid: int | None, args: dict) -> dict:
    event = {"ph": "M", "name": name, "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _slice(name, category, pid, tid, start_us, end_us, args) -> dict:
    return {
        "ph": "X",
        "name": name,
        "cat": category,
        "pid": pid,
        "tid": tid,
        "ts": start_us,
        "dur": round(end_us - start_us, 3),
        "args": args,
    }


def write(trace: dict, path: str) -> None:
    """Save `trace` as compact JSON at `path`."""
    with open(path + ".tmp", "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    os.replace(path + ".tmp", path)  # readers never see a half-written file


@dataclass(frozen=True)
class Slice:
    """One slice of a track as read back: times in milliseconds from the trace's origin."""

    kind: str
    name: str
    step: int
    microbatch: int | None
    start_ms: float
    duration_ms: float


@dataclass(frozen=True)
class Track:
    """One rank's row of the timeline."""

    rank: int
    stage: int
    replica: int
    slices: tuple[Slice, ...]
    node: str | None = None  # the host it ran on (traces before nodes were recorded: None)

    @property
    def label(self) -> str:
        where = f"rank {self.rank}" + (f" · {self.node}" if self.node else "")
        return f"{where}\nstage {self.stage} · replica {self.replica}"


def read_tracks(trace: dict) -> list[Track]:
    """The tracks of a trace written by `to_trace`, ordered by replica then stage."""
    where, slices = {}, {}
    for event in trace["traceEvents"]:
        if event["ph"] == "M" and event["name"] == "thread_name":
            args = event["args"]
            where[event["tid"]] = (args["rank"], args["stage"], args["replica"], args.get("node"))
        elif event["ph"] == "X":
            args = event.get("args", {})
            slices.setdefault(event["tid"], []).append(
                Slice(
                    event["cat"],
                    event["name"],
                    args.get("step", -1),
                    args.get("microbatch"),
                    event["ts"] / 1e3,
                    event["dur"] / 1e3,
                )
            )
    tracks = [
        Track(rank, stage, replica, tuple(slices.get(tid, ())), node)
        for tid, (rank, stage, replica, node) in where.items()
    ]
    return sorted(tracks, key=lambda t: (t.replica, t.stage))


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
