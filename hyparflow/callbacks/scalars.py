"""TensorBoard scalar tags of the profiler and the values each step writes under them."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorboard.plugins.scalar import metadata

from hyparflow.callbacks.aggregate import JobStep
from hyparflow.callbacks.breakdown import ALL_KINDS, KINDS, StepBreakdown
from hyparflow.engine import events
from hyparflow.traced import traced

STEP_MS = "step_ms/total"
COMPUTE_MS = "step_ms/compute"
P2P_WAIT_MS = "step_ms/p2p_wait"
IDLE_MS = "step_ms/idle"
KIND_MS = {kind: f"step_ms/{kind}" for kind in ALL_KINDS}  # step_ms/forward, ...
TENSOR_MS = KIND_MS[events.TENSOR]  # tensor-parallel collectives, only with tensor parallelism
EXPERTS_MS = KIND_MS[events.EXPERTS]  # expert exchanges, only with expert parallelism
THROUGHPUT = "throughput/samples_per_sec"
BUBBLE_MEASURED = "pipeline/bubble_measured"
BUBBLE_THEORETICAL = "pipeline/bubble_theoretical"
EFFICIENCY = "scaling/efficiency"

# Tags every rank's run has when the engine recorded spans (more than one rank).
# With tensor parallelism (Strategy(tensor=T), T > 1) both runs also have TENSOR_MS; with
# expert parallelism (experts=E, E > 1) EXPERTS_MS.
RANK_TAGS = (
    STEP_MS,
    *(KIND_MS[k] for k in KINDS),
    COMPUTE_MS,
    P2P_WAIT_MS,
    IDLE_MS,
    THROUGHPUT,
    BUBBLE_MEASURED,
)
# Tags of the aggregate run; EFFICIENCY only when a baseline throughput is given.
AGGREGATE_TAGS = (*RANK_TAGS, BUBBLE_THEORETICAL)


def _time_values(wall: float, seconds: dict[str, float] | None, busy_wall: float):
    """Milliseconds of the step and its parts; idle is `busy_wall` minus every span. Compute is
    forward + backward + weight, which exclude the tensor collectives inside them (breakdown.py)."""
    values = {STEP_MS: 1e3 * wall}
    if seconds is not None:
        values.update({KIND_MS[k]: 1e3 * v for k, v in seconds.items()})
        values[COMPUTE_MS] = 1e3 * sum(seconds.get(kind, 0.0) for kind in events.COMPUTE)
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


class ScalarWriter:
    """A `tf.summary` file writer for one run that writes many steps in one compiled call.

    Eager `tf.summary.scalar` dispatches several ops per scalar, which adds up to milliseconds
    per step with a dozen tags; inside one `tf.function` per flush the same writes are cheap.
    """

    def __init__(self, path: str):
        self._writer = tf.summary.create_file_writer(path)
        self._functions = {}  # tag tuple -> compiled writer of rows with those tags

    def write(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Write `(step, {tag: value})` rows and flush them to disk."""

        by_tags: dict[tuple, list] = {}
        for step, values in rows:
            by_tags.setdefault(tuple(values), []).append((step, values))
        for tags, group in by_tags.items():
            if tags not in self._functions:
                self._functions[tags] = self._compile(tags)
            steps = np.array([step for step, _ in group], np.int64)
            values = np.array([[v[tag] for tag in tags] for _, v in group], np.float32)
            self._functions[tags](tf.constant(steps), tf.constant(values))
        self._writer.flush()

    def _compile(self, tags: tuple):
        writer = self._writer
        # What tf.summary.scalar writes, minus its name scope: in a while loop that would
        # turn every tag into "while/<tag>".
        scalar = metadata.create_summary_metadata(display_name=None, description=None)

        signature = (
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None, len(tags)], tf.float32),
        )  # any number of rows, one trace

        def write_rows(steps, values):
            def body(i):
                for j, tag in enumerate(tags):
                    tf.summary.write(tag, values[i, j], step=steps[i], metadata=scalar)
                return (i + 1,)

            with writer.as_default():
                tf.while_loop(lambda i: i < tf.shape(steps)[0], body, (tf.constant(0),))

        return traced(write_rows, input_signature=signature)

    def close(self) -> None:
        self._writer.close()
