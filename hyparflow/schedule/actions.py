"""What a stage does, as data: one `Action` per pass or transfer of one micro-batch.

A stage's step is an ordered list of actions (`Schedule`: one list per stage); the builders
(`builders.py`) make the passes, `with_transfers` adds the transfers each pass implies, and the
engine's walk dispatches each action by its `ActionKind` (torch.distributed.pipelining's
`_Action` plays the same role).
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
    BACKWARD = "backward"  # the whole backward, or its input-gradient half where W is split off
    WEIGHT = "weight"  # the weight-gradient half of a split backward (zero-bubble schedules)
    RECV_ACTIVATIONS = "recv_activations"  # the previous stage's outputs: this forward's inputs
    SEND_ACTIVATIONS = "send_activations"  # this forward's outputs, to the next stage
    RECV_GRADIENTS = "recv_gradients"  # the next stage's input gradients: this backward's start
    SEND_GRADIENTS = "send_gradients"  # this backward's input gradients, to the previous stage

    @property
    def computes(self) -> bool:
        """A pass of the stage's layers (not a transfer)."""
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)


FORWARD, BACKWARD, WEIGHT = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
_SHORT = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W", ActionKind.RECV_ACTIVATIONS: "RA",
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
        if not is_count(self.microbatch, minimum=0):
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


def W(microbatch: int) -> Action:
    """Shorthand for `Action("weight", microbatch)`."""
    return Action(WEIGHT, microbatch)


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
        WEIGHT: (None, None),  # the stage's own weights: nothing moves
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


def is_count(value, minimum: int) -> bool:
    """`value` is an int (not a bool) of at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    """Refuse a stage or micro-batch count that is not a positive int."""
    if not is_count(num_stages, 1):
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if not is_count(num_microbatches, 1):
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
