"""A step's gradient path: how a stage's summed gradients are reduced and applied.

Four paths, chosen once per trainer by `build_gradient_path` from what `_build_gradient_path`
built for the stage's `GradientForm` and strategy:

- whole: reduce every gradient across stages and replicas after the backward
  (`GradientSync`), then run the optimizer step (`Update`);
- ZeRO-1: reduce-scatter, update this replica's slice, all-gather (`ShardedUpdate`, which
  plays both parts);
- by segment, plain or ZeRO-1: each segment reduced and applied as soon as the step's last
  backward has finished it (`SegmentUpdate`), falling back to the whole path in a step where
  that is not usable (a finite check needs every gradient first; an optimizer state not built).

The trainer's step calls `begin` and `finish` and has no branch per path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from hyparflow.engine import events


class SegmentHooks(NamedTuple):
    """What the walk calls with j after segment j of a segmented stage's backward: `last` in
    the step's last backward, `earlier` in the others (None: nothing)."""

    last: Callable[[int], None] | None = None
    earlier: Callable[[int], None] | None = None


class GradientPath(Protocol):
    """What a training step asks of its gradient path."""

    def begin(self, check_numerics: bool) -> SegmentHooks:
        """Start a step; return what the walk calls as each segment of a backward ends."""
        ...

    def finish(self, losses, check_numerics: bool) -> float:
        """Reduce and apply what the backward left; return the model's regularization."""
        ...


class WholePath:
    """Reduce after the backward, then step the optimizer: `gradient_sync.reduce()` gives the
    gradients and `update.apply` applies them, handed over (`give_up`), or `sharded` (a
    `ShardedUpdate`) does both under ZeRO-1. `update.check_finite` checks them when asked,
    naming the trainer's `step()`. The walk calls `gradient_sync.on_segment_done` (its
    overlap with the backward) after each segment. `span(kind)` and `guard(operation)` are
    the trainer's (they change with its recorder and watchdog)."""

    def __init__(self, gradient_sync, update, sharded, *, span, guard, step):
        self.gradient_sync, self.update, self.sharded = gradient_sync, update, sharded
        self.application = update if sharded is None else sharded
        self._span, self._guard, self._step = span, guard, step

    def begin(self, check_numerics: bool) -> SegmentHooks:
        return SegmentHooks(last=self.gradient_sync.on_segment_done)

    def finish(self, losses, check_numerics: bool) -> float:
        with (
            self._span(events.ALLREDUCE),
            self._guard("reduce gradients across stages and replicas"),
        ):
            gradients = self._reduce(check_numerics)
        if check_numerics:
            self.update.check_finite(losses, gradients.as_list(), self._step())
        with self._span(events.OPTIMIZER):
            # the update owns them now: it lets each group's go once applied
            return self.application.apply(gradients.give_up())

    def _reduce(self, check_numerics: bool):
        """The step's reduced gradients; ZeRO-1 keeps each rank's own too for a finite check."""
        if self.sharded is None:
            return self.gradient_sync.reduce()
        return self.sharded.reduce(keep_local=check_numerics)


class BySegmentPath:
    """`segment_update` (`SegmentUpdate`, plain or sharded) in the steps it can serve,
    `whole` in the others."""

    def __init__(self, segment_update, whole: WholePath):
        self.segment_update, self.whole = segment_update, whole
        self._active = False

    def begin(self, check_numerics: bool) -> SegmentHooks:
        self._active = self.segment_update.serves(check_numerics)
        if not self._active:
            return self.whole.begin(check_numerics)
        return self.segment_update.begin()

    def finish(self, losses, check_numerics: bool) -> float:
        if not self._active:
            return self.whole.finish(losses, check_numerics)
        return self.segment_update.finish()  # applied during the backward (inside its spans)


def build_gradient_path(gradient_sync, update, segment_update, sharded, *, span, guard, step):
    """The path for what the trainer built: `sharded` (a `ShardedUpdate`, or None) replaces the
    reduction and the update; `segment_update` (or None) runs the update by segment.
    `span`, `guard` and `step` as for `WholePath`."""
    whole = WholePath(gradient_sync, update, sharded, span=span, guard=guard, step=step)
    return whole if segment_update is None else BySegmentPath(segment_update, whole)
