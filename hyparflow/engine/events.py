"""Timed spans of what a rank did in each step (forward, backward, waits, reductions).

The trainer records them only while a profiler is attached; otherwise every span is a shared
no-op context, so profiling off costs one attribute lookup per action.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

# Span kinds, in the order a timeline shows them.
FORWARD = "forward"  # stage compute, forward (includes the loss at the last stage)
BACKWARD = "backward"  # stage compute, backward (its input half, where W is split off)
WEIGHT = "weight"  # stage compute, the weight half of a split backward (zero-bubble schedules)
RECV = "recv"  # blocked waiting for a neighbour's activations or gradients
SEND = "send"  # posting sends and waiting for them to complete at the end of the step
ALLREDUCE = "allreduce"  # gradient sums across shared stages and replicas
OPTIMIZER = "optimizer"  # regularization gradients and the optimizer update
KINDS = (FORWARD, BACKWARD, WEIGHT, RECV, SEND, ALLREDUCE, OPTIMIZER)
COMPUTE = (FORWARD, BACKWARD, WEIGHT)  # the work a pipeline stage exists to do
# Tensor-parallel collectives (hyparflow.tensor's allreduces and allgathers), recorded only with
# tensor parallelism. They run inside the compiled forward and backward, so their spans lie
# inside forward and backward spans: a breakdown takes them out of compute (breakdown.py).
TENSOR = "tensor"
# Expert parallelism's exchanges (tokens to their experts' ranks and back, and the routing
# counts' allreduce), recorded only with `experts` > 1; inside forward and backward spans too.
EXPERTS = "experts"
# ZeRO-3's all-gathers of a segment's weights before its forward and its backward's
# recomputation (`Strategy.shard_weights`), inside forward and backward spans too.
GATHER = "gather"
INNER = (TENSOR, EXPERTS, GATHER)  # kinds whose spans lie inside compute spans


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

    `span` times a block on the stepping thread; `add` records a span timed elsewhere, from any
    thread (a collective inside a compiled step ends on a TensorFlow executor thread). Such a
    span belongs to the current step and to the micro-batch of the span open at that moment;
    outside a step it is dropped.

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
        self._microbatch = None  # of the span open on the stepping thread
        self._lock = threading.Lock()  # `add` may come from another thread

    @contextlib.contextmanager
    def step(self, samples: int, microbatches: int):
        with self._lock:
            self._spans = []
            self._in_step = True
        start = self.clock()
        try:
            yield
        finally:
            end = self.clock()
            with self._lock:
                self._in_step = False
                spans = tuple(self._spans)
            self._steps.append(StepRecord(self._step, start, end, samples, microbatches, spans))
            self._step += 1

    @contextlib.contextmanager
    def span(self, kind: str, microbatch: int | None = None):
        if not self._in_step:  # validation and inference passes are not training steps
            yield
            return
        start = self.clock()
        if microbatch is None:  # a span inside another (a gather's wait) is of its micro-batch
            microbatch = self._microbatch
        outer, self._microbatch = self._microbatch, microbatch
        try:
            yield
        finally:
            self._microbatch = outer
            span = Span(kind, self._step, microbatch, start, self.clock())
            with self._lock:
                self._spans.append(span)

    def add(self, kind: str, start: float, end: float) -> None:
        """Record a span timed elsewhere (`start`, `end` on this recorder's clock), from any
        thread, e.g. `Traffic.listener` for each tensor-parallel collective."""
        with self._lock:
            if self._in_step:
                self._spans.append(Span(kind, self._step, self._microbatch, start, end))

    def take(self) -> list[StepRecord]:
        steps, self._steps = self._steps, []
        return steps


def span_listener(recorder: Recorder, kind: str):
    """`comm.traffic.Traffic.listener` recording each in-graph collective as a span of `kind`
    into `recorder` (it runs on a TensorFlow executor thread while the stepping thread is
    inside a forward or backward)."""

    def heard(start: float, end: float, nbytes: int) -> None:
        recorder.add(kind, start, end)

    return heard


_NO_SPAN = contextlib.nullcontext()


class Spans:
    """Where a trainer's parts time their work: each part is handed this one object when it is
    built, and `record_into(recorder)` chooses what they record into (None: nothing)."""

    def __init__(self) -> None:
        self.recorder: Recorder | None = None

    def record_into(self, recorder: Recorder | None) -> None:
        self.recorder = recorder

    def span(self, kind: str, microbatch: int | None = None):
        """A timed span of `kind` (of `microbatch`), or a no-op when nothing records."""
        if self.recorder is None:
            return _NO_SPAN
        return self.recorder.span(kind, microbatch)

    def step(self, samples: int, microbatches: int):
        """The span of one step of `samples` in `microbatches`."""
        if self.recorder is None:
            return _NO_SPAN
        return self.recorder.step(samples, microbatches)
