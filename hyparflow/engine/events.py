"""Timed spans of what a rank did in each step (forward, backward, waits, reductions).

The trainer records them only while a profiler is attached; otherwise every span is a shared
no-op context, so profiling off costs one attribute lookup per action.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

# Span kinds, in the order a timeline shows them.
FORWARD = "forward"  # stage compute, forward (includes the loss at the last stage)
BACKWARD = "backward"  # stage compute, backward
RECV = "recv"  # blocked waiting for a neighbour's activations or gradients
SEND = "send"  # posting sends and waiting for them to complete at the end of the step
ALLREDUCE = "allreduce"  # gradient sums across shared stages and replicas
OPTIMIZER = "optimizer"  # regularization gradients and the optimizer update
KINDS = (FORWARD, BACKWARD, RECV, SEND, ALLREDUCE, OPTIMIZER)


@dataclass(frozen=True)
class Span:
    """One timed activity: `start`/`end` in seconds of `time.perf_counter()` on this rank."""

    kind: str
    step: int
    microbatch: int | None
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class StepRecord:
    """A whole step on one rank: its wall-clock bounds, samples and spans."""

    step: int
    start: float
    end: float
    samples: int  # global batch size of the step
    microbatches: int  # micro-batches this rank's replica ran
    spans: tuple[Span, ...]


class Recorder:
    """Collects spans step by step; `take()` hands over the finished steps.

    Example:
        >>> recorder = Recorder()
        >>> with recorder.step(samples=32, microbatches=4):
        ...     with recorder.span("forward", microbatch=0):
        ...         pass
        >>> [record.spans[0].kind for record in recorder.take()]
        ['forward']
    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._steps: list[StepRecord] = []
        self._spans: list[Span] = []
        self._step = 0
        self._in_step = False

    @contextlib.contextmanager
    def step(self, samples: int, microbatches: int):
        self._spans = []
        self._in_step = True
        start = self.clock()
        try:
            yield
        finally:
            end = self.clock()
            self._in_step = False
            self._steps.append(
                StepRecord(self._step, start, end, samples, microbatches, tuple(self._spans))
            )
            self._step += 1

    @contextlib.contextmanager
    def span(self, kind: str, microbatch: int | None = None):
        if not self._in_step:  # validation and inference passes are not training steps
            yield
            return
        start = self.clock()
        try:
            yield
        finally:
            self._spans.append(Span(kind, self._step, microbatch, start, self.clock()))

    def take(self) -> list[StepRecord]:
        steps, self._steps = self._steps, []
        return steps


_NO_SPAN = contextlib.nullcontext()


def no_span(kind: str, microbatch: int | None = None):
    """The span used when nothing records: one shared, reusable no-op context."""
    return _NO_SPAN


def no_step(samples: int, microbatches: int):
    return _NO_SPAN
