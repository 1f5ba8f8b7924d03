"""The training schedules by name: `make_schedule` builds one and validates it."""

from __future__ import annotations

from hyparflow.schedule.actions import Schedule
from hyparflow.schedule.builders import gpipe, one_f_one_b
from hyparflow.schedule.interleaved import interleaved
from hyparflow.schedule.validation import validate
from hyparflow.schedule.zero_bubble import zero_bubble

SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zero_bubble": zero_bubble,
    "interleaved": interleaved,  # takes the chunks per stage too
}


def make_schedule(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """Build the training schedule called `name` ("gpipe", "1f1b", "zero_bubble" or
    "interleaved", whose stages hold `virtual_stages` model chunks each), validated
    (`validate`).

    Example:
        >>> make_schedule("1f1b", 4, 8)[3][:4]
        [F0, B0, F1, B1]
        >>> make_schedule("interleaved", 2, 2, virtual_stages=2)[1]
        [F0, F1, F0c1, B0c1, F1c1, B1c1, B0, B1]
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; use one of {sorted(SCHEDULES)}")
    if name == "interleaved":
        schedule = interleaved(num_stages, num_microbatches, virtual_stages)
    elif virtual_stages != 1:
        raise ValueError(f"schedule {name!r} holds one model chunk per stage, not {virtual_stages}")
    else:
        schedule = SCHEDULES[name](num_stages, num_microbatches)
    validate(schedule, num_microbatches)
    return schedule
