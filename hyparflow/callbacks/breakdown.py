"""Where one rank's training step went: compute, waits, reductions and the rest."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hyparflow.engine import events

# The span kinds a breakdown reports, in table order; with tensor or expert parallelism also
# TENSOR or EXPERTS, the collectives inside forward and backward.
KINDS = events.KINDS
ALL_KINDS = (*KINDS, *events.INNER)


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds one rank spent on each kind of work in one step, and what follows from them.

    `seconds` maps every span kind (forward, backward, recv, send, allreduce, optimizer, and
    with tensor or expert parallelism tensor or experts) to its total in the step, forward and
    backward without the collectives inside them (see `breakdown`), so the kinds never
    overlap; it is None
    when the engine recorded no spans (a single process, where `hf.fit` is plain `model.fit`
    and only the step's wall time is known). `samples` is the
    global batch size (None when unknown); `microbatches` is how many this rank's replica ran.

    Example:
        >>> b = StepBreakdown(3, 0.0, 0.010, 64, 4, dict(forward=0.004, backward=0.004,
        ...     recv=0.001, send=0.0, allreduce=0.0, optimizer=0.0005))
        >>> round(b.idle * 1e3, 3), round(b.bubble(), 3), b.throughput
        (0.5, 0.158, 6400.0)
    """

    step: int
    start: float  # seconds, this rank's clock
    wall: float
    samples: int | None
    microbatches: int
    seconds: dict[str, float] | None

    @property
    def detailed(self) -> bool:
        return self.seconds is not None

    @property
    def compute(self) -> float | None:
        """Forward, backward and weight passes: the work a pipeline stage exists to do."""
        if self.seconds is None:
            return None
        return sum(self.seconds.get(kind, 0.0) for kind in events.COMPUTE)

    @property
    def idle(self) -> float | None:
        """Wall time covered by no span: the engine's own bookkeeping between actions."""
        if self.seconds is None:
            return None
        return max(0.0, self.wall - sum(self.seconds.values()))

    @property
    def pipeline_time(self) -> float | None:
        """The step without its final gradient reduction and optimizer update, i.e. the
        pipeline's fill-run-drain phase that the bubble formula describes."""
        if self.seconds is None:
            return None
        return self.wall - self.seconds[events.ALLREDUCE] - self.seconds[events.OPTIMIZER]

    def bubble(self, makespan: float | None = None) -> float | None:
        """Share of the pipeline's makespan this rank was not computing: `1 - compute/makespan`.

        `makespan` is the longest pipeline phase among the stages of this rank's pipeline in
        this step (see `aggregate.makespans`); alone, a rank can only use its own.
        """
        makespan = self.pipeline_time if makespan is None else makespan
        if self.seconds is None or makespan is None or makespan <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.compute / makespan))

    @property
    def throughput(self) -> float | None:
        """Global samples per second if every step took as long as this rank's."""
        if not self.samples or self.wall <= 0:
            return None
        return self.samples / self.wall

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepBreakdown:
        return cls(**data)


def breakdown(record: events.StepRecord, inner: tuple = ()) -> StepBreakdown:
    """Sum a recorded step's spans by kind; `inner` (`events.INNER` kinds the run has: tensor,
    experts) are reported even in a step without their spans, so every rank and step has the
    same kinds.

    The engine's spans follow each other (a rank does one thing at a time), except inner
    spans: a tensor-parallel collective or an expert exchange runs inside the compiled forward
    or backward, so its span lies inside a forward or backward span. Counting both would count
    that time twice, so the rule is: forward and backward are their spans minus the inner time
    inside them (their compute), and each inner kind is the sum of its spans. The kinds then
    add up to the covered time and idle stays the rest of the step.

    Example:
        >>> span = events.Span("forward", 0, 0, 1.0, 1.5)
        >>> breakdown(events.StepRecord(0, 1.0, 2.0, 8, 1, (span,))).seconds["forward"]
        0.5
        >>> allreduce = events.Span("tensor", 0, 0, 1.25, 1.375)
        >>> s = breakdown(events.StepRecord(0, 1.0, 2.0, 8, 1, (span, allreduce))).seconds
        >>> s["forward"], s["tensor"]
        (0.375, 0.125)
    """
    seconds = dict.fromkeys((*KINDS, *inner), 0.0)
    for span in record.spans:
        seconds[span.kind] = seconds.get(span.kind, 0.0) + span.duration
    inner = [s for s in record.spans if s.kind in events.INNER]
    if inner:
        for span in record.spans:
            if span.kind in events.COMPUTE:
                seconds[span.kind] -= sum(_overlap(span, t) for t in inner)
    return StepBreakdown(
        step=record.step,
        start=record.start,
        wall=record.end - record.start,
        samples=record.samples,
        microbatches=record.microbatches,
        seconds=seconds,
    )


def _overlap(a: events.Span, b: events.Span) -> float:
    return max(0.0, min(a.end, b.end) - max(a.start, b.start))


def wall_only(step: int, start: float, end: float, samples: int | None) -> StepBreakdown:
    """A step known only from callback hooks (one process): wall time and throughput."""
    return StepBreakdown(step, start, end - start, samples, 1, None)
