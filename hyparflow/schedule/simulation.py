"""A pure simulator of a schedule's timing on an ideal machine, and the bounds it is checked by."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hyparflow.schedule.actions import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    B,
    F,
    Schedule,
    check_sizes,
    chunks_of,
    place_of,
    virtual_stage,
)


def peak_in_flight(stage_actions: Sequence[Action]) -> int:
    """Largest number of micro-batches forwarded but not yet backwarded on one stage (where the
    stage splits its backwards, not yet through their weight pass, W, which still reads them).

    This bounds the activations a stage must keep alive (and the receive slots it needs).

    Example:
        >>> from hyparflow.schedule import gpipe, one_f_one_b
        >>> peak_in_flight(one_f_one_b(4, 8)[0]), peak_in_flight(gpipe(4, 8)[0])
        (4, 8)
    """
    release = WEIGHT if any(a.kind is WEIGHT for a in stage_actions) else BACKWARD
    in_flight, peak = set(), 0
    for action in stage_actions:  # transfers (`with_transfers`) change nothing here
        if action.kind is FORWARD:  # interleaved: each chunk's micro-batch counts
            in_flight.add((action.microbatch, action.chunk))
            peak = max(peak, len(in_flight))
        elif action.kind is release:
            in_flight.discard((action.microbatch, action.chunk))
    return peak


def theoretical_bubble(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a flushed pipeline with equal stages: `(p - 1) / (m + p - 1)`.

    Example:
        >>> theoretical_bubble(4, 12)
        0.2
    """
    check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


class DeadlockError(RuntimeError):
    """A schedule whose stages wait on each other forever (or on an action never scheduled)."""


@dataclass
class Simulation:
    """Timing of a schedule: each action's (start, end), the makespan, busy time and bubble.

    `span` is the longest time a stage took from the end of its own setup to its last
    action's end (the makespan when there is no setup): what a profiler's step, which begins
    once the loop has cut the micro-batches, sees of the pipeline."""

    times: dict[tuple[int, Action], tuple[float, float]]
    makespan: float
    busy: list[float]
    span: float | None = None

    @property
    def bubble(self) -> float:
        """Fraction of stage-time spent idle in the pipeline, setups left out:
        `1 - sum(busy) / (num_stages * span)`."""
        span = self.makespan if self.span is None else self.span
        if span == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * span)


def simulate(
    schedule: Schedule,
    forward_time: float | Sequence[float] = 1.0,
    backward_time: float | Sequence[float] = 2.0,
    comm_time: float = 0.0,
    setup_time: float | Sequence[float] = 0.0,
    weight_time: float | Sequence[float] | None = None,
) -> Simulation:
    """Execute `schedule` on an ideal machine and return when every action starts and ends.

    F(s, m) waits for F(s-1, m) plus `comm_time`; B(s, m) waits for F(s, m) and for B(s+1, m)
    plus `comm_time`; W(s, m), the weight pass split off a backward, waits for B(s, m) and
    takes `weight_time` (needed when the schedule has W passes; `backward_time` is then the
    input-gradient pass alone); each stage runs its list in order, one action at a time, after
    `setup_time` of its own work before its first action (a training loop's bookkeeping
    between steps; not counted as busy). Times may be one number, one per stage, or, for an
    interleaved schedule, one per model chunk in model order (`virtual_stage`). Raises
    `DeadlockError` if the stages can never finish.

    Example:
        >>> from hyparflow.schedule import gpipe
        >>> sim = simulate(gpipe(4, 12), forward_time=1.0, backward_time=1.0)
        >>> sim.makespan, round(sim.bubble, 6)
        (30.0, 0.2)
    """
    num_stages, num_chunks = len(schedule), chunks_of(schedule)
    splits = any(a.kind is WEIGHT for actions in schedule for a in actions)
    if splits and weight_time is None:
        raise ValueError("the schedule splits backwards into B and W passes: give weight_time")
    setup_times = _per_stage(setup_time, num_stages, "setup_time")
    per_chunk = {
        kind: _per_chunk(value, num_stages, num_chunks, name)
        for kind, value, name in (
            (FORWARD, forward_time, "forward_time"),
            (BACKWARD, backward_time, "backward_time"),
            (WEIGHT, weight_time or 0.0, "weight_time"),
        )
    }

    def duration(stage: int, action: Action) -> float:
        return per_chunk[action.kind][virtual_stage(stage, action.chunk, num_stages)]

    for stage, actions in enumerate(schedule):
        if len(set(actions)) != len(actions):
            raise ValueError(f"stage {stage} lists an action twice: {actions}")
        if not all(a.kind.computes for a in actions):
            raise ValueError(f"stage {stage} lists transfers; simulate the passes only")

    times: dict[tuple[int, Action], tuple[float, float]] = {}
    next_index = [0] * num_stages
    stage_free = list(setup_times)
    progressed = True
    while progressed:
        progressed = False
        for stage, actions in enumerate(schedule):
            while next_index[stage] < len(actions):
                action = actions[next_index[stage]]
                ready = ready_time(times, stage, action, num_stages, comm_time, num_chunks)
                if ready is None:
                    break
                start = max(ready, stage_free[stage])
                end = start + duration(stage, action)
                times[stage, action] = (start, end)
                stage_free[stage] = end
                next_index[stage] += 1
                progressed = True

    raise_if_blocked(schedule, next_index)
    busy = [sum(duration(s, a) for a in actions) for s, actions in enumerate(schedule)]
    span = max(
        (end - setup for end, setup in zip(stage_free, setup_times, strict=True)), default=0.0
    )
    return Simulation(times=times, makespan=max(stage_free, default=0.0), busy=busy, span=span)


def raise_if_blocked(schedule: Schedule, next_index: list[int]) -> None:
    """Raise `DeadlockError` naming each stage that stopped short of its last action
    (`next_index[s]`: the first action stage `s` never ran)."""
    blocked = [
        f"stage {s} waits at {actions[next_index[s]]}"
        for s, actions in enumerate(schedule)
        if next_index[s] < len(actions)
    ]
    if blocked:
        raise DeadlockError("schedule deadlocks: " + "; ".join(blocked))


def ready_time(times, stage, action, num_stages, comm_time, num_chunks=1) -> float | None:
    """When `action`'s dependencies are met on `stage` (`times`: the (start, end) of the
    actions run so far), or None if one has not run yet. With `num_chunks` chunks per stage
    (interleaved), a forward waits for the model's previous chunk (`virtual_stage`), wherever
    it runs, and a backward for the next."""
    virtual = virtual_stage(stage, action.chunk, num_stages)
    mb = action.microbatch
    deps = []
    if action.is_forward:
        if virtual > 0:
            previous, chunk = place_of(virtual - 1, num_stages)
            deps.append((previous, F(mb, chunk), comm_time))
    elif action.kind is WEIGHT:
        deps.append((stage, B(mb, action.chunk), 0.0))
    else:
        deps.append((stage, F(mb, action.chunk), 0.0))
        if virtual < num_stages * num_chunks - 1:
            following, chunk = place_of(virtual + 1, num_stages)
            deps.append((following, B(mb, chunk), comm_time))
    ready = 0.0
    for dep_stage, dep, delay in deps:
        if (dep_stage, dep) not in times:
            return None
        ready = max(ready, times[dep_stage, dep][1] + delay)
    return ready


def _per_chunk(value, num_stages: int, num_chunks: int, name: str) -> list[float]:
    """`value` for each model chunk in model order: given per chunk, or per stage (each of a
    stage's chunks takes its stage's time)."""
    if not isinstance(value, (int, float)) and len(value) == num_stages * num_chunks:
        return [float(v) for v in value]
    stages = _per_stage(value, num_stages, name)
    return [stages[place_of(k, num_stages)[0]] for k in range(num_stages * num_chunks)]


def _per_stage(value, num_stages: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * num_stages
    values = [float(v) for v in value]
    if len(values) != num_stages:
        raise ValueError(f"{name} has {len(values)} entries but the schedule has {num_stages}")
    return values
