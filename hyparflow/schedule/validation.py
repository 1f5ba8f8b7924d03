"""One check that a schedule is a step the engine can run exactly (`validate`)."""

from __future__ import annotations

import itertools

from hyparflow.schedule.actions import WEIGHT, Action, ActionKind, B, F, Schedule, W
from hyparflow.schedule.simulation import DeadlockError, simulate


class ScheduleError(ValueError):
    """A schedule the engine cannot run as one exact step (`validate` says why)."""


def validate(schedule: Schedule, num_microbatches: int, training: bool = True) -> None:
    """Raise `ScheduleError` unless `schedule` is one step over `num_microbatches`: on every
    stage each micro-batch forwarded once and, in training, backwarded once after its forward
    (and, on a stage that splits its backwards, its weight pass W once after its B);
    transfers (`with_transfers`' lists) sent in the order the neighbour receives them; and the
    stages never wait on each other forever.

    Example:
        >>> from hyparflow.schedule import one_f_one_b
        >>> validate(one_f_one_b(2, 2), 2)
        >>> validate([[F(0), B(0)], [B(0), F(0)]], 1)
        Traceback (most recent call last):
        ...
        hyparflow.schedule.validation.ScheduleError: stage 1 runs B0 before F0
    """
    passes = [[a for a in actions if a.kind.computes] for actions in schedule]
    for stage, actions in enumerate(passes):
        _check_passes(stage, actions, num_microbatches, training)
    _check_transfers_pair(schedule)
    try:
        simulate(passes, weight_time=0.0)
    except DeadlockError as error:
        raise ScheduleError(str(error)) from None


def _check_passes(stage: int, actions: list[Action], count: int, training: bool) -> None:
    splits = training and any(a.kind is WEIGHT for a in actions)
    passes = [F] + ([B] if training else []) + ([W] if splits else [])
    expected = [make(k) for make in passes for k in range(count)]
    if sorted(actions, key=repr) != sorted(expected, key=repr):
        missing = sorted(set(expected) - set(actions), key=repr)
        extra = [a for a in actions if actions.count(a) > 1 or a not in expected]
        raise ScheduleError(f"stage {stage} misses {missing} or repeats or adds {extra}")
    position = {action: i for i, action in enumerate(actions)}  # each pass once, checked above
    for earlier, later in itertools.pairwise(passes):  # F before B before W
        for k in range(count):
            if position[later(k)] < position[earlier(k)]:
                raise ScheduleError(f"stage {stage} runs {later(k)} before {earlier(k)}")


def _check_transfers_pair(schedule: Schedule) -> None:
    """Each link's sends in the order its other end receives them (MPI keeps one sender's
    messages of one tag in order, so a mismatch would swap micro-batches)."""
    pairs = ((ActionKind.SEND_ACTIVATIONS, ActionKind.RECV_ACTIVATIONS, 1),
             (ActionKind.SEND_GRADIENTS, ActionKind.RECV_GRADIENTS, -1))  # fmt: skip
    for stage, actions in enumerate(schedule):
        for send, receive, step in pairs:
            peer = stage + step
            sent = [a.microbatch for a in actions if a.kind is send]
            if not 0 <= peer < len(schedule):
                if sent:
                    raise ScheduleError(f"stage {stage} sends {send.value} to no stage")
                continue
            received = [a.microbatch for a in schedule[peer] if a.kind is receive]
            if sent != received:
                raise ScheduleError(
                    f"stage {stage} sends {send.value} of micro-batches {sent}; "
                    f"stage {peer} receives {received}"
                )
