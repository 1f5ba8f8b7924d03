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
_SHORT = {
    FORWARD: "F",
    BACKWARD: "B",
    WEIGHT: "W",
    ActionKind.RECV_ACTIVATIONS: "RA",
    ActionKind.SEND_ACTIVATIONS: "SA",
    ActionKind.RECV_GRADIENTS: "RG",
    ActionKind.SEND_GRADIENTS: "SG",
}


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
    chunk: int = 0  # which of the stage's model chunks (interleaved schedules; else 0)

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", ActionKind(self.kind))
        except ValueError:
            kinds = ", ".join(repr(k.value) for k in ActionKind)
            raise ValueError(f"Action kind must be one of {kinds}, got {self.kind!r}") from None
        if not is_count(self.microbatch, minimum=0):
            raise ValueError(f"Action microbatch must be an int >= 0, got {self.microbatch!r}")
        if not is_count(self.chunk, minimum=0):
            raise ValueError(f"Action chunk must be an int >= 0, got {self.chunk!r}")

    @property
    def is_forward(self) -> bool:
        return self.kind is FORWARD

    def __repr__(self) -> str:
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{_SHORT[self.kind]}{self.microbatch}{chunk}"


def F(microbatch: int, chunk: int = 0) -> Action:
    """Shorthand for `Action("forward", microbatch, chunk)`."""
    return Action(FORWARD, microbatch, chunk)


def B(microbatch: int, chunk: int = 0) -> Action:
    """Shorthand for `Action("backward", microbatch, chunk)`."""
    return Action(BACKWARD, microbatch, chunk)


def W(microbatch: int, chunk: int = 0) -> Action:
    """Shorthand for `Action("weight", microbatch, chunk)`."""
    return Action(WEIGHT, microbatch, chunk)


def chunks_of(schedule: Sequence[Sequence[Action]]) -> int:
    """How many model chunks each stage of `schedule` holds (1 unless interleaved).

    Example:
        >>> chunks_of([[F(0), F(0, chunk=1), B(0, chunk=1), B(0)]])
        2
    """
    return 1 + max((a.chunk for actions in schedule for a in actions), default=0)


def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
    """The place in the model of `chunk` on `stage`: stage `s` holds chunks `s`, `s + p`, ...
    of the model's `p * v` (Megatron's interleaved layout)."""
    return chunk * num_stages + stage


def place_of(virtual: int, num_stages: int) -> tuple[int, int]:
    """The (stage, chunk) that holds model chunk `virtual` (`virtual_stage`'s inverse)."""
    chunk, stage = divmod(virtual, num_stages)
    return stage, chunk


def with_transfers(
    stage_actions: Sequence[Action], stage: int, num_stages: int, num_chunks: int = 1
) -> list[Action]:
    """`stage_actions` (passes only) with the transfers each pass implies, in the order stage
    `stage` of `num_stages` runs them: a forward receives its inputs before (but at the model's
    first chunk) and sends its outputs after (but at its last); a backward receives its output
    gradients before (but at the last chunk) and sends its input gradients after (but at the
    first). With `num_chunks` chunks per stage (interleaved), chunk `c` of stage `s` is the
    model's chunk `c * num_stages + s` (`virtual_stage`). The engine walks these lists; the
    simulator and the memory plan read the passes.

    Example:
        >>> with_transfers([F(0), B(0)], stage=1, num_stages=3)
        [RA0, F0, SA0, RG0, B0, SG0]
        >>> with_transfers([F(0), B(0)], stage=0, num_stages=1)
        [F0, B0]
        >>> with_transfers([F(0, chunk=1), B(0, chunk=1)], stage=1, num_stages=2, num_chunks=2)
        [RA0c1, F0c1, B0c1, SG0c1]
    """
    lowered = []
    for action in stage_actions:
        if not action.kind.computes:
            raise ValueError(f"{action!r} is a transfer already; give the passes only")
        virtual = virtual_stage(stage, action.chunk, num_stages)
        first, last = virtual == 0, virtual == num_stages * num_chunks - 1
        before, after = {  # each None where there is no neighbour
            FORWARD: (
                None if first else ActionKind.RECV_ACTIVATIONS,
                None if last else ActionKind.SEND_ACTIVATIONS,
            ),
            BACKWARD: (
                None if last else ActionKind.RECV_GRADIENTS,
                None if first else ActionKind.SEND_GRADIENTS,
            ),
            WEIGHT: (None, None),  # the stage's own weights: nothing moves
        }[action.kind]
        lowered += [Action(before, action.microbatch, action.chunk)] if before else []
        lowered.append(action)
        lowered += [Action(after, action.microbatch, action.chunk)] if after else []
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
