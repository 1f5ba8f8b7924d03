"""One check that a schedule is a step the engine can run exactly (`validate`)."""

from __future__ import annotations

import itertools

from hyparflow.schedule.actions import (
    WEIGHT,
    Action,
    ActionKind,
    B,
    F,
    Schedule,
    W,
    chunks_of,
    place_of,
    virtual_stage,
)
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
    num_chunks = chunks_of(schedule)
    for stage, actions in enumerate(passes):
        _check_passes(stage, actions, num_microbatches, training, num_chunks)
    _check_transfers_pair(schedule, num_chunks)
    try:
        simulate(passes, weight_time=0.0)
    except DeadlockError as error:
        raise ScheduleError(str(error)) from None


def _check_passes(
    stage: int, actions: list[Action], count: int, training: bool, num_chunks: int
) -> None:
    splits = training and any(a.kind is WEIGHT for a in actions)
    passes = [F] + ([B] if training else []) + ([W] if splits else [])
    units = [(k, c) for c in range(num_chunks) for k in range(count)]  # micro-batch, chunk
    expected = [make(k, c) for make in passes for k, c in units]
    if sorted(actions, key=repr) != sorted(expected, key=repr):
        missing = sorted(set(expected) - set(actions), key=repr)
        extra = [a for a in actions if actions.count(a) > 1 or a not in expected]
        raise ScheduleError(f"stage {stage} misses {missing} or repeats or adds {extra}")
    position = {action: i for i, action in enumerate(actions)}  # each pass once, checked above
    for earlier, later in itertools.pairwise(passes):  # F before B before W
        for k, c in units:
            if position[later(k, c)] < position[earlier(k, c)]:
                raise ScheduleError(f"stage {stage} runs {later(k, c)} before {earlier(k, c)}")


def _check_transfers_pair(schedule: Schedule, num_chunks: int) -> None:
    """Each link's sends in the order its other end receives them (MPI keeps one sender's
    messages of one tag in order, so a mismatch would swap micro-batches). A message is named by
    its micro-batch and the model chunk that receives it (`virtual_stage`)."""
    num_stages = len(schedule)
    pairs = (
        (ActionKind.SEND_ACTIVATIONS, ActionKind.RECV_ACTIVATIONS, 1),
        (ActionKind.SEND_GRADIENTS, ActionKind.RECV_GRADIENTS, -1),
    )
    links: dict[tuple[ActionKind, int, int], list[list[tuple[int, int]]]] = {}
    for stage, actions in enumerate(schedule):
        for send, receive, step in pairs:
            for action in actions:
                virtual = virtual_stage(stage, action.chunk, num_stages)
                if action.kind is send:
                    target = virtual + step
                    if not 0 <= target < num_stages * num_chunks:
                        raise ScheduleError(f"stage {stage} sends {send.value} to no stage")
                    peer = place_of(target, num_stages)[0]
                    links.setdefault((send, stage, peer), [[], []])[0].append(
                        (action.microbatch, target)
                    )
                elif action.kind is receive:
                    source = place_of(virtual - step, num_stages)[0]
                    links.setdefault((send, source, stage), [[], []])[1].append(
                        (action.microbatch, virtual)
                    )
    for (send, stage, peer), (sent, received) in links.items():
        if sent != received:
            if num_chunks == 1:  # name micro-batches alone
                what, sent, received = (
                    "micro-batches",
                    [m for m, _ in sent],
                    [m for m, _ in received],
                )
            else:
                what = "(micro-batch, model chunk)"
            raise ScheduleError(
                f"stage {stage} sends {send.value} of {what} {sent}; "
                f"stage {peer} receives {received}"
            )
