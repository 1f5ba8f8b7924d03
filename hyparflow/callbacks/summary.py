"""Running totals of a profiled run, per rank and for the job, as the `profile.json` summary.

The first step at each global batch size traces the stage functions (seconds, not
milliseconds), so it is left out of the totals; the per-step scalars and the timeline keep it.
If every step is such a warm-up step, they are all summarized.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from hyparflow.callbacks.aggregate import JobStep, scaling_efficiency
from hyparflow.callbacks.breakdown import KINDS, StepBreakdown
from hyparflow.engine import events
from hyparflow.schedule import make_schedule, simulate

SUMMARY_FILE = "profile.json"
FORMAT_VERSION = 1


@dataclass
class Totals:
    """Sums over the summarized steps of one rank (or of the job: step time and samples)."""

    steps: int = 0
    wall: float = 0.0
    samples: int = 0
    seconds: dict[str, float] | None = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    makespan: float = 0.0  # of the rank's pipeline, over the steps where it ran micro-batches
    busy: float = 0.0  # compute in those steps
    microbatches: int = 0

    def add(
        self,
        wall: float,
        samples: int | None,
        seconds: dict[str, float] | None,
        makespan: float | None = None,
        microbatches: int = 0,
    ) -> None:
        self.steps += 1
        self.microbatches += microbatches
        self.wall += wall
        self.samples += samples or 0
        if makespan is not None and seconds is not None:
            self.makespan += makespan
            self.busy += sum(seconds.get(kind, 0.0) for kind in events.COMPUTE)
        if seconds is None or self.seconds is None:
            self.seconds = None  # one step without spans makes the split unknown
        else:
            for kind, value in seconds.items():  # tensor too, with tensor parallelism
                self.seconds[kind] = self.seconds.get(kind, 0.0) + value

    def per_step_ms(self) -> dict[str, float | None]:
        """Mean milliseconds per step: the step and, when known, each part of it (compute is
        forward + backward + weight, without the tensor collectives inside them: breakdown.py)."""
        n = max(self.steps, 1)
        ms = {"step": 1e3 * self.wall / n}
        parts = dict.fromkeys((*KINDS, "compute", "p2p_wait", "idle"))
        if self.seconds is not None:
            s = self.seconds
            parts.update({k: 1e3 * v / n for k, v in s.items()})
            parts["compute"] = 1e3 * sum(s.get(kind, 0.0) for kind in events.COMPUTE) / n
            parts["p2p_wait"] = 1e3 * s[events.RECV] / n
            parts["idle"] = max(0.0, 1e3 * (self.wall - sum(s.values())) / n)
        ms.update(parts)
        return ms

    def bubble(self) -> float | None:
        """`1 - compute / makespan`, both summed over the steps (a time-weighted mean)."""
        if self.makespan <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.busy / self.makespan))

    def throughput(self) -> float | None:
        return self.samples / self.wall if self.samples and self.wall > 0 else None

    def per_microbatch(self, kind: str) -> float | None:
        """Mean seconds of `kind` (forward, backward or weight) per micro-batch."""
        if self.seconds is None or self.microbatches == 0:
            return None
        return self.seconds.get(kind, 0.0) / self.microbatches


def simulated_bubble(
    stage_of_rank: Sequence[int],
    totals: Sequence[Totals],
    schedule: str | None,
    microbatches: int,
    virtual_stages: int = 1,
) -> float | None:
    """The bubble an ideal machine would show with these measured per-stage forward, backward
    (and, for zero-bubble schedules, weight) times per micro-batch (no communication, no
    overhead): it differs from the formula by the stages' imbalance, and from the measurement by
    everything else. An interleaved stage's time is split evenly over its `virtual_stages`
    model chunks.

    Example:
        >>> t = Totals(steps=1, wall=1.0, microbatches=4,
        ...            seconds=dict(forward=0.4, backward=0.4, recv=0, send=0, allreduce=0,
        ...                         optimizer=0))
        >>> round(simulated_bubble([0, 1], [t, t], "gpipe", 4), 6)
        0.2
    """
    num_stages = max(stage_of_rank, default=0) + 1
    if schedule is None or num_stages < 2 or microbatches < 1:
        return None
    times = {kind: [[] for _ in range(num_stages)] for kind in events.COMPUTE}
    for stage, t in zip(stage_of_rank, totals, strict=True):
        for kind, per_stage in times.items():
            value = t.per_microbatch(kind)
            if value is not None:
                per_stage[stage].append(value)
    if any(not values for per_stage in times.values() for values in per_stage):
        return None
    mean = {
        kind: [sum(v) / len(v) / virtual_stages for v in per_stage]
        for kind, per_stage in times.items()
    }
    sim = simulate(
        make_schedule(schedule, num_stages, microbatches, virtual_stages),
        forward_time=mean[events.FORWARD],
        backward_time=mean[events.BACKWARD],
        weight_time=mean[events.WEIGHT],
    )
    return sim.bubble


class RunSummary:
    """Collects every rank's breakdowns and the job's steps on the gathering rank.

    `ranks` lists `{"rank", "stage", "replica", "node"}` for every rank, in rank order (the
    node: the host the rank ran on).
    """

    def __init__(self, layout: dict, ranks: Sequence[dict], baseline: float | None = None):
        self.layout = dict(layout)
        self.rank_info = [dict(r) for r in ranks]
        self.baseline = baseline
        self.recorded = 0
        # per rank, `{category: {"calls", "bytes"}}` of its in-graph collectives over the fit
        # (tensor, experts), set by the profiler at its end; None without them
        self.collectives: list[dict] | None = None
        self.warmup_steps: list[int] = []
        self._sizes_seen: set = set()
        self._rank_totals = [Totals() for _ in ranks]
        self._job = Totals()
        self._theoretical: list[float] = []
        # Warm-up steps are summarized only if nothing else ever is.
        self._warm_rank_totals = [Totals() for _ in ranks]
        self._warm_job = Totals()
        self._warm_theoretical: list[float] = []

    def add(self, job: JobStep, ranks: Sequence[StepBreakdown]) -> None:
        """One step: the job's view and each rank's breakdown, in rank order."""
        self.recorded += 1
        warm = job.samples not in self._sizes_seen
        self._sizes_seen.add(job.samples)
        if warm:
            self.warmup_steps.append(job.step)
        rank_totals = self._warm_rank_totals if warm else self._rank_totals
        for totals, b, makespan, bubble in zip(
            rank_totals, ranks, job.makespans, job.bubbles, strict=True
        ):
            totals.add(
                b.wall,
                b.samples,
                b.seconds,
                makespan if bubble is not None else None,
                b.microbatches,
            )
        (self._warm_job if warm else self._job).add(job.wall, job.samples, None)
        if job.bubble_theoretical is not None:
            (self._warm_theoretical if warm else self._theoretical).append(job.bubble_theoretical)

    def to_dict(self) -> dict:
        """The `profile.json` document (see docs/profiling.md)."""
        steady = self._job.steps > 0
        rank_totals = self._rank_totals if steady else self._warm_rank_totals
        job = self._job if steady else self._warm_job
        theoretical = self._theoretical if steady else self._warm_theoretical
        ranks = []
        for r, (info, totals) in enumerate(zip(self.rank_info, rank_totals, strict=True)):
            ranks.append(
                {
                    **info,
                    "steps": totals.steps,
                    "ms_per_step": totals.per_step_ms(),
                    "bubble": totals.bubble(),
                    "throughput": totals.throughput(),
                    **({"collectives": self.collectives[r]} if self.collectives else {}),
                }
            )
        bubbles = [r["bubble"] for r in ranks if r["bubble"] is not None]
        throughput = job.throughput()
        job_ms = {"step": job.per_step_ms()["step"]}
        for part in ranks[0]["ms_per_step"] if ranks else ():
            if part != "step":  # the job's parts are the mean over ranks
                known = [r["ms_per_step"].get(part) for r in ranks]
                job_ms[part] = None if None in known else sum(known) / len(known)
        return {
            "version": FORMAT_VERSION,
            "layout": self.layout,
            "baseline_throughput": self.baseline,
            "steps": {
                "recorded": self.recorded,
                "summarized": job.steps,
                "warmup_excluded": self.warmup_steps if steady else [],
            },
            "ranks": ranks,
            "job": {
                "ms_per_step": job_ms,
                "throughput": throughput,
                "bubble_measured": sum(bubbles) / len(bubbles) if bubbles else None,
                "bubble_theoretical": (
                    sum(theoretical) / len(theoretical) if theoretical else None
                ),
                "bubble_simulated": simulated_bubble(
                    [r["stage"] for r in self.rank_info],
                    rank_totals,
                    self.layout.get("schedule"),
                    int(self.layout.get("microbatches") or 0),
                    int(self.layout.get("virtual_stages", 1)),
                ),
                "efficiency": scaling_efficiency(
                    throughput, int(self.layout.get("world_size", len(ranks))), self.baseline
                ),
            },
        }


def write_summary(summary: dict, path: str) -> None:
    """Save the summary as indented JSON at `path` (atomically: readers never see half)."""
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(path + ".tmp", path)


def load_summary(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
