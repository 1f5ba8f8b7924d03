"""Pipeline schedules as data (GPipe, 1F1B) and a pure simulator of their timing.

A schedule is one ordered list of actions per stage: stage `s` executes `schedule[s]` strictly in
order. Two schedules are provided:

- GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism"): every stage runs all forwards, then all backwards. Each stage holds the
  activations of all `m` micro-batches at once.
- 1F1B, a.k.a. PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training"): stage `s` runs `p - s - 1` warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. Same bubble as GPipe, but at most `p - s`
  micro-batches are in flight on stage `s`.

Nothing here imports MPI, TensorFlow or the rest of hyparflow: the engine walks these lists,
and the simulator, the memory plan, the profiler, tests and the CLI read or simulate them, so
it sits below all of them (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

Schedule = list[list["Action"]]


class ActionKind(Enum):
    """What a stage does in one action: a pass over one micro-batch, or a transfer of its
    tensors to or from a neighbouring stage."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECV_ACTIVATIONS = "recv_activations"  # the previous stage's outputs: this forward's inputs
    SEND_ACTIVATIONS = "send_activations"  # this forward's outputs, to the next stage
    RECV_GRADIENTS = "recv_gradients"  # the next stage's input gradients: this backward's start
    SEND_GRADIENTS = "send_gradients"  # this backward's input gradients, to the previous stage

    @property
    def computes(self) -> bool:
        """A pass of the stage's layers (not a transfer)."""
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD)


FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD
_SHORT = {FORWARD: "F", BACKWARD: "B", ActionKind.RECV_ACTIVATIONS: "RA",
          ActionKind.SEND_ACTIVATIONS: "SA", ActionKind.RECV_GRADIENTS: "RG",
          ActionKind.SEND_GRADIENTS: "SG"}  # fmt: skip


@dataclass(frozen=True)
class Action:
    """One unit of a stage's work on one micro-batch: its forward or backward pass, or a
    transfer (`ActionKind`). `kind` may be given by its value ("forward").

    Example:
        >>> Action("forward", 3), Action(ActionKind.BACKWARD, 3)
        (F3, B3)
    """

    kind: ActionKind
    microbatch: int

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", ActionKind(self.kind))
        except ValueError:
            kinds = ", ".join(repr(k.value) for k in ActionKind)
            raise ValueError(f"Action kind must be one of {kinds}, got {self.kind!r}") from None
        if not _is_count(self.microbatch, minimum=0):
            raise ValueError(f"Action microbatch must be an int >= 0, got {self.microbatch!r}")

    @property
    def is_forward(self) -> bool:
        return self.kind is FORWARD

    def __repr__(self) -> str:
        return f"{_SHORT[self.kind]}{self.microbatch}"


def F(microbatch: int) -> Action:
    """Shorthand for `Action("forward", microbatch)`."""
    return Action(FORWARD, microbatch)


def B(microbatch: int) -> Action:
    """Shorthand for `Action("backward", microbatch)`."""
    return Action(BACKWARD, microbatch)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: on every stage, all forwards in order, then all backwards in order.

    Example:
        >>> gpipe(2, 3)
        [[F0, F1, F2, B0, B1, B2], [F0, F1, F2, B0, B1, B2]]
    """
    _check_sizes(num_stages, num_microbatches)
    stage = [F(i) for i in range(num_microbatches)] + [B(i) for i in range(num_microbatches)]
    return [list(stage) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, alternate one forward and one backward, drain.

    Stage `s` first runs `min(p - s - 1, m)` forwards, so at most `min(p - s, m)` micro-batches
    are in flight on it at any time.

    Example:
        >>> one_f_one_b(2, 3)
        [[F0, F1, B0, F2, B1, B2], [F0, B0, F1, B1, F2, B2]]
    """
    _check_sizes(num_stages, num_microbatches)
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        actions = [F(i) for i in range(warmup)]
        for i in range(warmup, num_microbatches):
            actions += [F(i), B(i - warmup)]
        actions += [B(i) for i in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Evaluation and prediction: every stage forwards every micro-batch in order.

    Example:
        >>> forward_only(2, 2)
        [[F0, F1], [F0, F1]]
    """
    _check_sizes(num_stages, num_microbatches)
    return [[F(i) for i in range(num_microbatches)] for _ in range(num_stages)]


def with_transfers(stage_actions: Sequence[Action], stage: int, num_stages: int) -> list[Action]:
    """`stage_actions` (passes only) with the transfers each pass implies, in the order stage
    `stage` of `num_stages` runs them: a forward receives its inputs before (but at the first
    stage) and sends its outputs after (but at the last); a backward receives its output
    gradients before (but at the last stage) and sends its input gradients after (but at the
    first). The engine walks these lists; the simulator and the memory plan read the passes.

    Example:
        >>> with_transfers([F(0), B(0)], stage=1, num_stages=3)
        [RA0, F0, SA0, RG0, B0, SG0]
        >>> with_transfers([F(0), B(0)], stage=0, num_stages=1)
        [F0, B0]
    """
    first, last = stage == 0, stage == num_stages - 1
    kinds = {  # (before, after) the pass, each None where there is no neighbour
        FORWARD: (None if first else ActionKind.RECV_ACTIVATIONS,
                  None if last else ActionKind.SEND_ACTIVATIONS),
        BACKWARD: (None if last else ActionKind.RECV_GRADIENTS,
                   None if first else ActionKind.SEND_GRADIENTS),
    }  # fmt: skip
    lowered = []
    for action in stage_actions:
        if not action.kind.computes:
            raise ValueError(f"{action!r} is a transfer already; give the passes only")
        before, after = kinds[action.kind]
        lowered += [Action(before, action.microbatch)] if before else []
        lowered.append(action)
        lowered += [Action(after, action.microbatch)] if after else []
    return lowered


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build the training schedule called `name` ("gpipe" or "1f1b").

    Example:
        >>> make_schedule("1f1b", 4, 8)[3][:4]
        [F0, B0, F1, B1]
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; use one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_microbatches)


def peak_in_flight(stage_actions: Sequence[Action]) -> int:
    """Largest number of micro-batches forwarded but not yet backwarded on one stage.

    This bounds the activations a stage must keep alive (and the receive slots it needs).

    Example:
        >>> peak_in_flight(one_f_one_b(4, 8)[0]), peak_in_flight(gpipe(4, 8)[0])
        (4, 8)
    """
    in_flight, peak = set(), 0
    for action in stage_actions:  # transfers (`with_transfers`) change nothing here
        if action.kind is FORWARD:
            in_flight.add(action.microbatch)
            peak = max(peak, len(in_flight))
        elif action.kind is BACKWARD:
            in_flight.discard(action.microbatch)
    return peak


def theoretical_bubble(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a flushed pipeline with equal stages: `(p - 1) / (m + p - 1)`.

    Example:
        >>> theoretical_bubble(4, 12)
        0.2
    """
    _check_sizes(num_stages, num_microbatches)
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
) -> Simulation:
    """Execute `schedule` on an ideal machine and return when every action starts and ends.

    F(s, m) waits for F(s-1, m) plus `comm_time`; B(s, m) waits for F(s, m) and for B(s+1, m)
    plus `comm_time`; each stage runs its list in order, one action at a time, after
    `setup_time` of its own work before its first action (a training loop's bookkeeping
    between steps; not counted as busy). Times may be one number or one per stage. Raises
    `DeadlockError` if the stages can never finish.

    Example:
        >>> sim = simulate(gpipe(4, 12), forward_time=1.0, backward_time=1.0)
        >>> sim.makespan, round(sim.bubble, 6)
        (30.0, 0.2)
    """
    num_stages = len(schedule)
    forward_times = _per_stage(forward_time, num_stages, "forward_time")
    backward_times = _per_stage(backward_time, num_stages, "backward_time")
    setup_times = _per_stage(setup_time, num_stages, "setup_time")
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
                ready = ready_time(times, stage, action, num_stages, comm_time)
                if ready is None:
                    break
                start = max(ready, stage_free[stage])
                duration = (forward_times if action.is_forward else backward_times)[stage]
                times[stage, action] = (start, start + duration)
                stage_free[stage] = start + duration
                next_index[stage] += 1
                progressed = True

    raise_if_blocked(schedule, next_index)
    busy = [
        sum(forward_times[s] if a.is_forward else backward_times[s] for a in actions)
        for s, actions in enumerate(schedule)
    ]
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


def ready_time(times, stage, action, num_stages, comm_time) -> float | None:
    """When `action`'s dependencies are met on `stage` (`times`: the (start, end) of the
    actions run so far), or None if one has not run yet."""
    deps = []
    if action.is_forward:
        if stage > 0:
            deps.append((stage - 1, F(action.microbatch), comm_time))
    else:
        deps.append((stage, F(action.microbatch), 0.0))
        if stage < num_stages - 1:
            deps.append((stage + 1, B(action.microbatch), comm_time))
    ready = 0.0
    for dep_stage, dep, delay in deps:
        if (dep_stage, dep) not in times:
            return None
        ready = max(ready, times[dep_stage, dep][1] + delay)
    return ready


def _per_stage(value, num_stages: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * num_stages
    values = [float(v) for v in value]
    if len(values) != num_stages:
        raise ValueError(f"{name} has {len(values)} entries but the schedule has {num_stages}")
    return values


def _is_count(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if not _is_count(num_stages, 1):
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if not _is_count(num_microbatches, 1):
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
