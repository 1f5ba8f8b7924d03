"""One step of the whole job from every rank's breakdown: pace, throughput, bubble, efficiency."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hyparflow.callbacks.breakdown import ALL_KINDS, StepBreakdown
from hyparflow.engine import events
from hyparflow.schedule import theoretical_bubble, zero_bubble_bubble


@dataclass(frozen=True)
class JobStep:
    """A step across all ranks.

    `wall` is the slowest rank's step time (the ranks are coupled, so it sets the pace).
    `makespans[r]` is the pipeline phase of rank r's pipeline: the longest among its stages.
    `bubbles[r]` is rank r's `1 - compute / makespan`; `bubble_measured` their mean, which for
    each pipeline is `1 - sum(compute) / (p * makespan)`, the definition the formula and the
    schedule simulator use. `bubble_theoretical` is the mean over ranks of the schedule's
    formula (`formula_bubble`) for the rank's micro-batch count `m`. `mean_seconds` is each
    span kind averaged over ranks (None without spans; tensor only where the ranks report it)
    and `mean_wall` the ranks' mean step time, so `mean_wall - sum(mean_seconds)` is the mean
    idle time.
    """

    step: int
    wall: float
    mean_wall: float
    samples: int | None
    throughput: float | None
    makespans: tuple[float | None, ...]
    bubbles: tuple[float | None, ...]
    bubble_measured: float | None
    bubble_theoretical: float | None
    efficiency: float | None
    mean_seconds: dict[str, float] | None

    def to_dict(self) -> dict:
        return asdict(self)


def scaling_efficiency(
    throughput: float | None, world_size: int, baseline: float | None
) -> float | None:
    """Throughput as a share of `world_size` perfectly scaled copies of one rank's `baseline`.

    Example:
        >>> scaling_efficiency(300.0, world_size=4, baseline=100.0)
        0.75
    """
    if throughput is None or not baseline:
        return None
    return throughput / (world_size * baseline)


def formula_bubble(
    num_stages: int,
    microbatches: int,
    schedule: str | None = None,
    seconds: dict | None = None,
    virtual_stages: int = 1,
) -> float | None:
    """The schedule's bubble by formula, or None for a rank that ran no micro-batch this step:
    `(p - 1) / (m + p - 1)` for GPipe and 1F1B, `(p - 1) / (v m + p - 1)` for interleaved 1F1B
    with `virtual_stages` v; for ZB-H1 (`schedule="zero_bubble"`) its idle fraction at the
    forward, backward and weight `seconds` of the step (`zero_bubble_bubble`), where they are
    known.

    Example:
        >>> times = dict(forward=0.2, backward=0.2, weight=0.2)
        >>> round(formula_bubble(2, 2), 4), round(formula_bubble(2, 2, "zero_bubble", times), 4)
        (0.3333, 0.1429)
        >>> formula_bubble(2, 2, "interleaved", virtual_stages=2)
        0.2
    """
    if microbatches < 1:
        return None
    if schedule == "interleaved":
        return theoretical_bubble(num_stages, microbatches * virtual_stages)
    if schedule == "zero_bubble" and seconds is not None:
        f, b, w = (seconds.get(kind, 0.0) / microbatches for kind in events.COMPUTE)
        if f + b + w > 0:
            return zero_bubble_bubble(num_stages, microbatches, f, b, w)
    return theoretical_bubble(num_stages, microbatches)


def makespans(ranks: Sequence[StepBreakdown], replicas: Sequence[int]) -> list[float | None]:
    """For each rank, the longest pipeline phase among the ranks of its pipeline (`replicas[r]`
    names rank r's pipeline). Every stage of a pipeline starts the step together (the engine
    shares the logs over all ranks between steps), so this is the pipeline's makespan; a stage
    that finishes early spends the rest outside its step, which its own times cannot show.

    Example:
        >>> spans = dict(forward=1.0, backward=1.0, recv=0.0, send=0.0, allreduce=0.0,
        ...              optimizer=0.5)
        >>> a = StepBreakdown(0, 0.0, 4.5, 8, 2, spans)  # pipeline phase 4.0
        >>> b = StepBreakdown(0, 0.0, 3.5, 8, 2, spans)  # pipeline phase 3.0
        >>> makespans([a, b], replicas=[0, 0]), makespans([a, b], replicas=[0, 1])
        ([4.0, 4.0], [4.0, 3.0])
    """
    longest: dict[int, float] = {}
    for b, q in zip(ranks, replicas, strict=True):
        if b.pipeline_time is not None:
            longest[q] = max(longest.get(q, 0.0), b.pipeline_time)
    return [longest.get(q) for q in replicas]


def job_step(
    ranks: Sequence[StepBreakdown],
    replicas: Sequence[int],
    num_stages: int,
    baseline: float | None = None,
    schedule: str | None = None,
    virtual_stages: int = 1,
) -> JobStep:
    """Combine one step's breakdowns from every rank (in rank order; `replicas[r]` is rank r's
    pipeline).

    Example:
        >>> a = StepBreakdown(0, 0.0, 0.010, 64, 4, None)
        >>> b = StepBreakdown(0, 0.0, 0.008, 64, 4, None)
        >>> s = job_step([a, b], [0, 0], num_stages=2, baseline=4000.0)
        >>> s.wall, s.throughput, s.bubble_theoretical, s.efficiency
        (0.01, 6400.0, 0.2, 0.8)
    """
    if not ranks:
        raise ValueError("job_step needs the breakdown of at least one rank")
    steps = {b.step for b in ranks}
    if len(steps) != 1:
        raise ValueError(f"job_step got breakdowns of different steps {sorted(steps)}")
    wall = max(b.wall for b in ranks)
    samples = ranks[0].samples
    throughput = samples / wall if samples and wall > 0 else None
    spans = makespans(ranks, replicas)
    # A replica left without samples (a tiny last batch) ran no pipeline: no bubble to speak of.
    bubbles = [
        b.bubble(m) if m is not None and b.microbatches > 0 else None
        for b, m in zip(ranks, spans, strict=True)
    ]
    known = [x for x in bubbles if x is not None]
    formulas = [
        formula_bubble(num_stages, b.microbatches, schedule, b.seconds, virtual_stages)
        for b in ranks
    ]
    formulas = [f for f in formulas if f is not None]
    detailed = [b for b in ranks if b.detailed]
    mean_seconds = None
    if detailed:
        kinds = [k for k in ALL_KINDS if any(k in b.seconds for b in detailed)]
        mean_seconds = {
            k: sum(b.seconds.get(k, 0.0) for b in detailed) / len(detailed) for k in kinds
        }
    return JobStep(
        step=ranks[0].step,
        wall=wall,
        mean_wall=sum(b.wall for b in ranks) / len(ranks),
        samples=samples,
        throughput=throughput,
        makespans=tuple(spans),
        bubbles=tuple(bubbles),
        bubble_measured=sum(known) / len(known) if known else None,
        bubble_theoretical=sum(formulas) / len(formulas) if formulas else None,
        efficiency=scaling_efficiency(throughput, len(ranks), baseline),
        mean_seconds=mean_seconds,
    )
