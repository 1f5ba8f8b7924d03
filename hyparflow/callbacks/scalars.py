"""TensorBoard scalar tags of the profiler and the values each step writes under them."""

from __future__ import annotations

from hyparflow.callbacks.aggregate import JobStep
from hyparflow.callbacks.breakdown import KINDS, StepBreakdown
from hyparflow.engine import events

STEP_MS = "step_ms/total"
COMPUTE_MS = "step_ms/compute"
P2P_WAIT_MS = "step_ms/p2p_wait"
IDLE_MS = "step_ms/idle"
KIND_MS = {kind: f"step_ms/{kind}" for kind in KINDS}  # step_ms/forward, step_ms/recv, ...
THROUGHPUT = "throughput/samples_per_sec"
BUBBLE_MEASURED = "pipeline/bubble_measured"
BUBBLE_THEORETICAL = "pipeline/bubble_theoretical"
EFFICIENCY = "scaling/efficiency"

# Tags every rank's run has when the engine recorded spans (more than one rank).
RANK_TAGS = (STEP_MS, *KIND_MS.values(), COMPUTE_MS, P2P_WAIT_MS, IDLE_MS, THROUGHPUT,
             BUBBLE_MEASURED)  # fmt: skip
# Tags of the aggregate run; EFFICIENCY only when a baseline throughput is given.
AGGREGATE_TAGS = (*RANK_TAGS, BUBBLE_THEORETICAL)


def _time_values(wall: float, seconds: dict[str, float] | None, busy_wall: float):
    """Milliseconds of the step and its parts; idle is `busy_wall` minus every span."""
    values = {STEP_MS: 1e3 * wall}
    if seconds is not None:
        values.update({KIND_MS[k]: 1e3 * seconds[k] for k in KINDS})
        values[COMPUTE_MS] = 1e3 * (seconds[events.FORWARD] + seconds[events.BACKWARD])
        values[P2P_WAIT_MS] = 1e3 * seconds[events.RECV]
        values[IDLE_MS] = max(0.0, 1e3 * (busy_wall - sum(seconds.values())))
    return values


def rank_values(b: StepBreakdown, bubble: float | None = None) -> dict[str, float]:
    """Scalars of one rank's step, with its `bubble` in its pipeline's makespan (from
    `aggregate.job_step`); parts that are unknown (one process) are left out.

    Example:
        >>> sorted(rank_values(StepBreakdown(0, 0.0, 0.002, 32, 1, None)).items())
        [('step_ms/total', 2.0), ('throughput/samples_per_sec', 16000.0)]
    """
    values = _time_values(b.wall, b.seconds, b.wall)
    if b.throughput is not None:
        values[THROUGHPUT] = b.throughput
    if bubble is not None:
        values[BUBBLE_MEASURED] = bubble
    return values


def job_values(j: JobStep) -> dict[str, float]:
    """Scalars of the aggregate run for one step: the slowest rank's step time, the mean over
    ranks of every part (idle included), throughput, bubble measured and theoretical, and
    efficiency."""
    values = _time_values(j.wall, j.mean_seconds, j.mean_wall)
    optional = {
        THROUGHPUT: j.throughput,
        BUBBLE_MEASURED: j.bubble_measured,
        BUBBLE_THEORETICAL: j.bubble_theoretical,
        EFFICIENCY: j.efficiency,
    }
    values.update({tag: v for tag, v in optional.items() if v is not None})
    return values


def write(writer, step: int, values: dict[str, float]) -> None:
    """Write `values` as scalars at `step` with a `tf.summary` file writer."""
    import tensorflow as tf

    with writer.as_default():
        for tag, value in values.items():
            tf.summary.scalar(tag, value, step=step)
