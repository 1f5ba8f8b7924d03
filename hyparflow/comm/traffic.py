"""What in-graph collectives moved: a `Traffic` record per kind (tag), in a `TrafficLog`.

Each trainer owns one log and passes its records to the parts that issue collectives (tensor
shards, expert dispatch, synchronised BatchNormalization, `hf.global_mean`), which count into
the record they were given: nothing is process-wide, so two trainers in one process keep
their counts apart and the profiler reads those of the trainer it profiles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class Traffic:
    """What one kind (tag) of in-graph collective did: calls, bytes this rank contributed,
    seconds inside MPI. `listener(start, end, nbytes)`, when set, hears of each call as it
    ends (the profiler records it as a span; times from `time.perf_counter`)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    listener: Callable | None = field(default=None, repr=False)

    def record(self, start: float, end: float, nbytes: int) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.seconds += end - start
        if self.listener is not None:
            self.listener(start, end, nbytes)

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0


class TrafficLog:
    """One trainer's `Traffic` records, one per tag, each created on first use. The tags:
    "tensor" (tensor-parallel layers), "batchnorm" (synchronised statistics), "experts" (mixture
    blocks' routing counts, and tokens sent to their experts and back) and its phases
    ("experts/dispatch", "experts/compute", "experts/combine"), "global" (`hf.global_mean`),
    "custom_step" (a model's own step's gradient sums)."""

    def __init__(self):
        self._records: dict[str, Traffic] = {}

    def of(self, tag: str) -> Traffic:
        """The record of collectives tagged `tag`."""
        return self._records.setdefault(tag, Traffic())

    def listen(self, tags: Iterable[str], listener: Callable | None) -> None:
        """Have `listener` (None: nobody) hear of each call counted in the records of `tags`."""
        for tag in tags:
            self.of(tag).listener = listener
