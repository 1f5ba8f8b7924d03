"""`ScalingProfiler`: a Keras callback showing where each rank's step time goes, in TensorBoard."""

from __future__ import annotations

import logging
import os
import socket
import time

import keras
import tensorflow as tf

from hyparflow.callbacks import gantt, scalars, timeline
from hyparflow.callbacks.aggregate import job_step
from hyparflow.callbacks.breakdown import breakdown, wall_only
from hyparflow.callbacks.clock import ClockAligner
from hyparflow.callbacks.summary import SUMMARY_FILE, RunSummary, write_summary
from hyparflow.engine import events
from hyparflow.engine.events import Recorder
from hyparflow.engine.sharded_optimizer import sharded_weights
from hyparflow.moe import expert_parallel
from hyparflow.tensor import collectives

logger = logging.getLogger(__name__)

AGGREGATE_RUN = "aggregate"
TIMELINE_STEPS = 9  # default timeline: steps 0-8, step 0 (tracing) dropped if others exist


def rank_run(rank: int) -> str:
    """The TensorBoard run (sub-folder of `log_dir`) of one rank."""
    return f"rank_{rank}"


class ScalingProfiler(keras.callbacks.Callback):
    """Per step and rank: compute, point-to-point wait, send, allreduce, optimizer and idle
    time (with tensor parallelism also its collectives, `tensor`, which compute excludes),
    throughput and the pipeline bubble, as TensorBoard scalars, a timeline and a summary.

    Writes under `log_dir` (every rank must be able to write there):

    - `rank_<r>/`: one TensorBoard run per rank;
    - `aggregate/`: the job's run: throughput, the measured bubble next to the theoretical
      `(p-1)/(m+p-1)`, and scaling efficiency against `baseline_throughput` (the samples/s of
      one rank training alone), when given;
    - `profile.json`: the run's summary, which `hyparflow report LOG_DIR` prints;
    - `timeline.json` (Chrome/Perfetto trace) and `timeline.png` (Gantt chart), unless
      `timeline` is False. `timeline=True` covers steps 1-8; `(first, last)` picks the steps.

    `profile_steps=(first, last)` captures a `tf.profiler` trace of those steps on every rank
    (TensorBoard's profile tab, run `rank_<r>`). Steps count from 0 over the whole fit; ranges
    are inclusive. Scalars are written at each epoch end (a small gather to rank 0).

    On one process `hf.fit` is plain `model.fit` and nothing records spans: only step time and,
    given `batch_size` (samples per step), throughput and efficiency are written.

    For example:
        profiler = hf.callbacks.ScalingProfiler("logs/run1", baseline_throughput=1800.0)
        hf.fit(model, x, y, batch_size=256, strategy="model", num_microbatches=8,
               callbacks=[profiler])
        # then: tensorboard --logdir logs/run1   or   hyparflow report logs/run1
    """

    # Its batch hooks neither read the logs nor stop training, but its per-step breakdown (the
    # bubble: fill and drain inside a step) needs the steps apart, as the shared logs keep them.
    needs_batch_logs = True

    def __init__(
        self,
        log_dir,
        profile_steps=None,
        baseline_throughput=None,
        timeline=True,
        batch_size=None,
    ):
        super().__init__()
        self.log_dir = os.fspath(log_dir)
        self.profile_steps = _step_range(profile_steps, "profile_steps")
        if baseline_throughput is not None and not baseline_throughput > 0:
            raise ValueError(
                f"baseline_throughput={baseline_throughput!r} must be the samples/s of one "
                "rank (a positive number), or None."
            )
        self.baseline_throughput = baseline_throughput
        if timeline in (True, False):
            self.timeline = timeline
        else:
            self.timeline = _step_range(timeline, "timeline")
        self.batch_size = batch_size
        self._trainer = None

    # --- hooks -----------------------------------------------------------------------------
    def attach_trainer(self, trainer) -> None:
        """Called by `hf.fit` on every rank before training: record that rank's spans."""
        self._trainer = trainer

    def on_train_begin(self, logs=None):
        trainer = self._trainer
        self._step = 0
        self._step_start = None
        self._single_steps = []
        self._profiling = False
        self._step_trace = None
        self._inner = ()  # the collectives inside compute this run reports (breakdown.py)
        if trainer is None:
            self._comm, self.rank = None, 0
            layout = {
                "world_size": 1,
                "kind": "single process",
                "stages": 1,
                "replicas": 1,
                "microbatches": 1,
                "schedule": None,
            }
            ranks = [{"rank": 0, "stage": 0, "replica": 0, "node": socket.gethostname()}]
            self._num_stages, self._schedule, self._virtual_stages = 1, None, 1
        else:
            layout, ranks = self._attach(trainer)
        self._layout, self._ranks = layout, ranks
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer = scalars.ScalarWriter(os.path.join(self.log_dir, rank_run(self.rank)))
        if self.rank == 0:
            self._aggregate_writer = scalars.ScalarWriter(os.path.join(self.log_dir, AGGREGATE_RUN))
            self._summary = RunSummary(layout, ranks, self.baseline_throughput)
            self._tracks = {r["rank"]: (r, []) for r in ranks}

    def _attach(self, trainer) -> tuple[dict, list]:
        """Record `trainer`'s steps; the run's layout and its ranks' places."""
        topo, strategy = trainer.topology, trainer.strategy
        self._comm = topo.world.Dup()  # our gathers and ping-pongs never meet the engine's
        self._clock = ClockAligner(self._comm)
        self.rank = topo.rank
        layout = {
            "world_size": topo.world.Get_size(),
            "kind": _kind(topo.num_stages, topo.num_replicas, topo.num_shards),
            "stages": topo.num_stages,
            "replicas": topo.num_replicas,
            "microbatches": strategy.microbatches,
            "schedule": strategy.schedule,
        }
        # Tensor and expert parallelism: their collectives are categories of their own.
        if topo.num_shards > 1:
            layout["tensor"] = topo.num_shards
            self._inner += (events.TENSOR,)
        if strategy.experts > 1:
            layout["experts"] = strategy.experts
            self._inner += (events.EXPERTS,)
        if trainer.shards_weights:  # ZeRO-3's gathers of weights, inside compute
            layout["shard_weights"] = True
            self._inner += (events.GATHER,)
        ranks = []
        for r in range(layout["world_size"]):
            stage, replica = topo.grid.coords(r)
            ranks.append({"rank": r, "stage": stage, "replica": replica, "node": topo.nodes[r]})
        self._num_stages, self._schedule = topo.num_stages, strategy.schedule
        self._virtual_stages = strategy.virtual_stages
        if strategy.virtual_stages > 1:  # model chunks per stage (interleaved)
            layout["virtual_stages"] = strategy.virtual_stages
        self._recorder = Recorder()
        trainer.attach_recorder(self._recorder)
        # the in-graph collectives' traffic (ZeRO-3's gathers are MPI calls the spans time)
        self._traffic_start = {
            kind: _moved(trainer.traffic, kind) for kind in self._inner if kind in _TAGS
        }
        return layout, ranks

    def on_train_batch_begin(self, batch, logs=None):
        if self.profile_steps is not None and self._step == self.profile_steps[0]:
            self._start_tf_profiler()
        if self._profiling:
            self._step_trace = tf.profiler.experimental.Trace("train", step_num=self._step, _r=1)
            self._step_trace.__enter__()
        if self._trainer is None:
            self._step_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._trainer is None and self._step_start is not None:
            self._single_steps.append(
                wall_only(self._step, self._step_start, time.perf_counter(), self.batch_size)
            )
        if self._step_trace is not None:
            self._step_trace.__exit__(None, None, None)
            self._step_trace = None
        if self.profile_steps is not None and self._step == self.profile_steps[1]:
            self._stop_tf_profiler()
        self._step += 1

    def on_epoch_end(self, epoch, logs=None):
        self._flush()

    def on_train_end(self, logs=None):
        self._flush()
        self._stop_tf_profiler()
        self._gather_traffic()
        try:
            if self.rank == 0:
                self._write_files()
        finally:
            self._close()

    # --- collecting ------------------------------------------------------------------------
    def _flush(self) -> None:
        """Gather the new steps on rank 0 for the job's view, then let every rank write its
        own scalars with its bubble (which needs its pipeline's makespan). Collective."""
        if self._trainer is None:
            steps, self._single_steps = self._single_steps, []
            records = []
        else:
            records = self._recorder.take()
            steps = [breakdown(r, inner=self._inner) for r in records]
        window = self._timeline_window()
        kept = [r for r in records if _within(r.step, window)]
        if kept:  # every rank records the same steps, so all ranks take part or none
            offset = self._clock.offset()
            kept = [timeline.aligned(r, offset) for r in kept]
        if self._comm is None:
            bubbles = self._combine([(steps, kept)])[0]
        else:
            gathered = self._comm.gather((steps, kept), root=0)
            bubbles = self._comm.scatter(
                self._combine(gathered) if self.rank == 0 else None, root=0
            )
        self._writer.write([(b.step, scalars.rank_values(b, bubbles.get(b.step))) for b in steps])

    def _combine(self, gathered) -> list[dict]:
        """On rank 0: the job's steps into the aggregate run and the summary; returns each
        rank's bubble per step."""
        by_step = {}
        for rank, (steps, kept) in enumerate(gathered):
            self._tracks[rank][1].extend(kept)
            for b in steps:
                by_step.setdefault(b.step, [None] * len(gathered))[rank] = b
        replicas = [r["replica"] for r in self._ranks]
        bubbles = [{} for _ in gathered]
        rows = []
        for step in sorted(by_step):
            ranks = by_step[step]
            if None in ranks:  # every rank records every step; skip rather than guess
                logger.warning("profiler: step %d is missing on some ranks; skipped", step)
                continue
            job = job_step(
                ranks,
                replicas,
                self._num_stages,
                self.baseline_throughput,
                self._schedule,
                self._virtual_stages,
            )
            rows.append((step, scalars.job_values(job)))
            self._summary.add(job, ranks)
            for rank, bubble in enumerate(job.bubbles):
                bubbles[rank][step] = bubble
        self._aggregate_writer.write(rows)
        return bubbles

    def _gather_traffic(self) -> None:
        """Rank 0's summary gets each rank's calls and bytes of the in-graph collectives this
        fit ran, by category (tensor, experts; collective over the ranks)."""
        if self._trainer is None or not self._inner:
            return
        mine = {}
        for kind, start in self._traffic_start.items():
            now = _moved(self._trainer.traffic, kind)
            moved = {tag: [n - s for n, s in zip(now[tag], start[tag], strict=True)] for tag in now}
            calls, nbytes, _ = moved[_TAGS[kind][0]]  # the category's collectives, all of them
            mine[kind] = {"calls": calls, "bytes": nbytes}
            if kind == events.GATHER:  # ZeRO-3's gathers ran ahead: how much compute hid
                transfers, waits = (moved[tag] for tag in _TAGS[kind])
                mine[kind]["hidden"] = _hidden_share(transfers[2], waits[2])
            if kind == events.EXPERTS:  # dispatch, compute and combine apart
                mine[kind]["phases"] = {
                    phase: _phase_totals(*moved[tag])
                    for phase, tag in expert_parallel.PHASE_TAGS.items()
                }
        gathered = self._comm.gather(mine, root=0)
        if self.rank == 0:
            self._summary.collectives = gathered

    def _timeline_window(self):
        if self.timeline is False:
            return None
        if self.timeline is not True:
            return self.timeline
        return (0, TIMELINE_STEPS - 1)

    # --- files -----------------------------------------------------------------------------
    def _write_files(self) -> None:
        write_summary(self._summary.to_dict(), os.path.join(self.log_dir, SUMMARY_FILE))
        tracks = [self._tracks[r["rank"]] for r in self._ranks]
        if not any(steps for _, steps in tracks):
            return
        if self.timeline is True:
            tracks = _without_tracing_step(tracks)
        trace = timeline.to_trace(tracks, self._layout)
        timeline.write(trace, os.path.join(self.log_dir, timeline.TIMELINE_FILE))
        try:
            gantt.draw(trace, os.path.join(self.log_dir, gantt.GANTT_FILE))
        except ImportError:
            logger.warning("profiler: matplotlib is not installed; timeline.png not drawn")

    # --- tf.profiler -----------------------------------------------------------------------
    def _start_tf_profiler(self) -> None:
        if self._profiling:
            return
        tf.profiler.experimental.start(os.path.join(self.log_dir, rank_run(self.rank)))
        self._profiling = True

    def _stop_tf_profiler(self) -> None:
        if self._step_trace is not None:
            self._step_trace.__exit__(None, None, None)
            self._step_trace = None
        if self._profiling:
            tf.profiler.experimental.stop()
            self._profiling = False

    def _close(self) -> None:
        self._writer.close()
        if self.rank == 0:
            self._aggregate_writer.close()
        if self._trainer is not None:
            self._trainer.attach_recorder(None)  # a later fit without the profiler pays nothing
            self._clock.free()
            self._comm.Free()
        self._trainer = None


# per span kind, its traffic records: the category's collectives first, then the experts' phases
_TAGS = {
    events.TENSOR: (collectives.TAG,),
    events.EXPERTS: (expert_parallel.TAG, *expert_parallel.PHASE_TAGS.values()),
    events.GATHER: (sharded_weights.TRANSFER_TAG, sharded_weights.WAIT_TAG),
}


def _moved(traffic, kind: str) -> dict:
    """Tag -> (calls, bytes, seconds) so far of the in-graph work of span kind `kind` in
    `traffic` (a trainer's `TrafficLog`): tensor collectives; expert collectives and the
    experts' phases."""
    records = {tag: traffic.of(tag) for tag in _TAGS[kind]}
    return {tag: (r.calls, r.bytes, r.seconds) for tag, r in records.items()}


def _hidden_share(seconds: float, waited: float) -> dict:
    """The gathers' `seconds` on their thread, the steps' `waited` for them, and the share of
    the gathers' time the steps did not wait for."""
    hidden = None if seconds <= 0 else max(0.0, 1.0 - waited / seconds)
    return {"ms": 1000.0 * seconds, "waited_ms": 1000.0 * waited, "share": hidden}


def _phase_totals(calls: int, nbytes: int, seconds: float) -> dict:
    """One expert phase's line of the summary."""
    return {"calls": calls, "bytes": nbytes, "ms": 1000.0 * seconds}


def _kind(stages: int, replicas: int, shards: int = 1) -> str:
    """The layout's kind, "auto" resolved."""
    if stages > 1:
        return "hybrid" if replicas > 1 else "model"
    return "tensor" if replicas == 1 and shards > 1 else "data"


def _within(step: int, window) -> bool:
    return window is not None and window[0] <= step <= window[1]


def _without_tracing_step(tracks):
    """Drop step 0 (it traces the stage functions and dwarfs the rest) if later steps exist."""
    if not any(r.step > 0 for _, steps in tracks for r in steps):
        return tracks
    return [(info, [r for r in steps if r.step > 0]) for info, steps in tracks]


def _step_range(value, name: str):
    if value is None:
        return None
    try:
        first, last = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name}={value!r} must be a pair (first, last) of step numbers, e.g. (10, 12)."
        ) from None
    if not 0 <= first <= last:
        raise ValueError(f"{name}={value!r} needs 0 <= first <= last, e.g. (10, 12).")
    return first, last
