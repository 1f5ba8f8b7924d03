"""Pipeline schedules as data (GPipe, 1F1B, ZB-H1, interleaved), one validator, a simulator.

A schedule is one ordered list of actions per stage: stage `s` executes `schedule[s]` strictly in
order (`actions.py`). The builders make the lists (`builders.py`; ZB-H1, whose backwards are
split into B and W passes, in `zero_bubble.py`, and interleaved 1F1B, whose stages hold several
model chunks, in `interleaved.py`; `make_schedule` names them, `registry.py`),
`validate` checks that one is
a step the engine can run exactly (`validation.py`), and `simulate` times it on an ideal machine
(`simulation.py`).

Nothing here imports MPI, TensorFlow or the rest of hyparflow: the engine walks these lists,
and the simulator, the memory plan, the profiler, tests and the CLI read or simulate them, so
it sits below all of them (docs/architecture.md).
"""

from hyparflow.schedule.actions import (
    BACKWARD,
    FORWARD,
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
    with_transfers,
)
from hyparflow.schedule.builders import forward_only, gpipe, one_f_one_b
from hyparflow.schedule.interleaved import interleaved
from hyparflow.schedule.registry import SCHEDULES, make_schedule
from hyparflow.schedule.simulation import (
    DeadlockError,
    Simulation,
    peak_in_flight,
    raise_if_blocked,
    ready_time,
    simulate,
    theoretical_bubble,
)
from hyparflow.schedule.validation import ScheduleError, validate
from hyparflow.schedule.zero_bubble import zero_bubble, zero_bubble_bubble

__all__ = [
    "BACKWARD",
    "FORWARD",
    "SCHEDULES",
    "Action",
    "ActionKind",
    "B",
    "DeadlockError",
    "F",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "chunks_of",
    "forward_only",
    "gpipe",
    "interleaved",
    "make_schedule",
    "one_f_one_b",
    "peak_in_flight",
    "place_of",
    "raise_if_blocked",
    "ready_time",
    "simulate",
    "theoretical_bubble",
    "validate",
    "virtual_stage",
    "with_transfers",
    "W",
    "WEIGHT",
    "zero_bubble",
    "zero_bubble_bubble",
]
