"""Synthetic step records of an ideal pipeline, from the schedule simulator, for profiler tests."""

from __future__ import annotations

from hyparflow.engine import events
from hyparflow.schedule import make_schedule, simulate


def simulated_steps(
    schedule: str = "gpipe",
    num_stages: int = 2,
    microbatches: int = 4,
    *,
    forward: float = 0.001,
    backward: float = 0.002,
    allreduce: float = 0.0,
    optimizer: float = 0.0,
    step: int = 0,
    start: float = 0.0,
    samples: int = 64,
) -> list[events.StepRecord]:
    """One step per stage as the engine would record it on an ideal machine.

    Every stage's step starts at `start`; waiting before an action is a `recv` span, then come
    the stage's `allreduce` and `optimizer` spans, all ending at the same moment after the
    pipeline's makespan (a stage that finishes its backwards early is idle until then).
    """
    actions = make_schedule(schedule, num_stages, microbatches)
    sim = simulate(actions, forward_time=forward, backward_time=backward)
    records = []
    for stage, stage_actions in enumerate(actions):
        spans, cursor = [], start
        for action in stage_actions:
            begin, end = (start + t for t in sim.times[stage, action])
            if begin > cursor:
                spans.append(events.Span(events.RECV, step, action.microbatch, cursor, begin))
            spans.append(events.Span(action.kind.value, step, action.microbatch, begin, end))
            cursor = end
        flush = start + sim.makespan
        spans.append(events.Span(events.ALLREDUCE, step, None, flush, flush + allreduce))
        spans.append(
            events.Span(
                events.OPTIMIZER, step, None, flush + allreduce, flush + allreduce + optimizer
            )
        )
        end = flush + allreduce + optimizer
        records.append(events.StepRecord(step, start, end, samples, microbatches, tuple(spans)))
    return records
