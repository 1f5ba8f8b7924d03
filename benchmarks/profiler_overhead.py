"""ScalingProfiler overhead: step time of a 2-stage pipeline with and without the profiler.

Run: .venv/bin/python benchmarks/profiler_overhead.py [--rounds 4] [--width 512]
     (starts `mpirun -np 2` itself; or run it under mpirun/srun with 2 ranks or more)

Prints, on rank 0, median times and ratios of:

1. recording inside the step: one fit in which the engine's recorder is attached on every
   other step, so on and off steps interleave and a busy machine's drift cancels out; and,
   free of that noise, the recorder alone timed on a step's worth of empty spans;
2. the profiler's epoch-end work (gather, bubble, TensorBoard writing) per step, timed by
   callbacks just before and after it, from the second epoch on (the first also traces the
   scalar writers: reported as a one-time cost, like the files written at the end of fit);
3. whole fits without and with the profiler, alternating, per step of the epochs after the
   first (end to end, but as noisy as the machine);
4. the no-op span the engine runs when no profiler is attached.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
from benchmarks.harness.launch import MPI_ENV, thread_env  # noqa: E402


def _arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="off/on pairs of whole fits")
    parser.add_argument("--width", type=int, default=512, help="units of each Dense layer")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="the first is not steady")
    return parser.parse_args(argv)


def _relaunch_under_mpirun() -> int:
    command = ["mpirun", "-np", "2", "--bind-to", "none", sys.executable, *sys.argv]
    return subprocess.call(command, env={**os.environ, **MPI_ENV, **thread_env(1)})


def _model(args):
    import keras

    inputs = keras.Input((args.width,))
    x = inputs
    for _ in range(args.layers):
        x = keras.layers.Dense(args.width, activation="relu")(x)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def _callbacks():
    """Timing callbacks (defined after Keras is imported)."""
    import keras

    from hyparflow.engine.events import Recorder

    class StepTimer(keras.callbacks.Callback):
        """Each step's wall time, batch begin to batch end, and when each epoch ended."""

        def __init__(self):
            super().__init__()
            self.times, self.epoch_ends = [], []

        def on_train_begin(self, logs=None):
            self.train_start = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._start)

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_ends.append(time.perf_counter())

    class EpochEndStart(keras.callbacks.Callback):
        """Placed just before the profiler: when its epoch-end work starts."""

        def __init__(self):
            super().__init__()
            self.starts = []

        def on_epoch_end(self, epoch, logs=None):
            self.starts.append(time.perf_counter())

    class AlternateRecorder(keras.callbacks.Callback):
        """Attach the engine's recorder on odd steps only; time every step."""

        def attach_trainer(self, trainer):
            self.trainer = trainer

        def on_train_begin(self, logs=None):
            self.on, self.off, self.count = [], [], 0

        def on_train_batch_begin(self, batch, logs=None):
            self.recording = self.count % 2 == 1
            self.trainer.attach_recorder(Recorder() if self.recording else None)
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            (self.on if self.recording else self.off).append(time.perf_counter() - self._start)
            self.count += 1

        def on_train_end(self, logs=None):
            self.trainer.attach_recorder(None)

    return StepTimer, EpochEndStart, AlternateRecorder


def _recorder_step_seconds(spans: int) -> float:
    """A recorded step with `spans` empty spans: what recording adds to a step, alone."""
    from hyparflow.engine.events import Recorder

    recorder = Recorder()

    def one():
        with recorder.step(samples=256, microbatches=4):
            for k in range(spans):
                with recorder.span("forward", k):
                    pass

    seconds = min(timeit.repeat(one, number=2_000, repeat=5)) / 2_000
    recorder.take()
    return seconds


def _no_op_span_seconds() -> float:
    from hyparflow.engine import events

    def one():
        with events.no_span("forward", 0):
            pass

    return min(timeit.repeat(one, number=100_000, repeat=5)) / 100_000


def main(argv=None) -> None:
    args = _arguments(argv)
    import keras
    import numpy as np
    from mpi4py import MPI

    import hyparflow as hf
    from hyparflow.callbacks import ScalingProfiler

    keras.config.disable_interactive_logging()
    StepTimer, EpochEndStart, AlternateRecorder = _callbacks()
    rng = np.random.default_rng(0)
    samples = args.batch_size * args.steps
    x = rng.normal(size=(samples, args.width)).astype("float32")
    y = rng.integers(0, 10, size=samples)
    model = _model(args)
    strategy = hf.Strategy("model", microbatches=args.microbatches, schedule="1f1b")
    fit = dict(batch_size=args.batch_size, epochs=args.epochs, verbose=0, strategy=strategy)
    hf.fit(model, x, y, **fit)  # warm-up: cut stages, trace, allocate buffers
    root = MPI.COMM_WORLD.bcast(
        tempfile.mkdtemp(prefix="hf-profiler-overhead-") if hf.rank() == 0 else None
    )

    alternate = AlternateRecorder()  # 1. recording inside the step, interleaved
    hf.fit(model, x, y, callbacks=[alternate], **fit)

    steady_steps = args.steps * (args.epochs - 1)
    per_step = {"off": [], "on": []}  # 3. whole fits
    epoch_end_work, first_epoch_end_work, end_of_fit = [], [], []  # 2. and one-time costs
    for round_ in range(args.rounds):
        for mode in ("off", "on"):
            timer, before = StepTimer(), EpochEndStart()
            callbacks = [timer]
            if mode == "on":
                profiler = ScalingProfiler(os.path.join(root, f"run{round_}"))
                callbacks = [before, profiler, timer]
            MPI.COMM_WORLD.Barrier()
            hf.fit(model, x, y, callbacks=callbacks, **fit)
            done = time.perf_counter()
            ends = timer.epoch_ends
            per_step[mode].append((ends[-1] - ends[0]) / steady_steps)
            if mode == "on":
                work = [end - start for start, end in zip(before.starts, ends)]
                first_epoch_end_work.append(work[0])
                epoch_end_work.extend(w / args.steps for w in work[1:])
                end_of_fit.append(done - ends[-1])

    if hf.rank() != 0:
        return
    median = statistics.median
    off_step, on_step = median(alternate.off), median(alternate.on)
    off_fit, on_fit = median(per_step["off"]), median(per_step["on"])
    epoch_end = median(epoch_end_work)
    span = _no_op_span_seconds()
    spans_per_step = 4 * args.microbatches + 3  # recv, compute, send per action; 3 per step
    recording = _recorder_step_seconds(spans_per_step)
    print(
        f"profiler overhead: {hf.size()} ranks, 2-stage pipeline (1f1b), "
        f"{args.microbatches} micro-batches, batch {args.batch_size}, MLP {args.layers} x "
        f"{args.width}, {args.steps} steps per epoch"
    )
    print(
        f"1. recording in the step (median of {len(alternate.off)} interleaved steps each): "
        f"off {1e3 * off_step:.3f} ms, on {1e3 * on_step:.3f} ms, on/off {on_step / off_step:.4f}"
    )
    print(
        f"   the recorder alone: {1e6 * recording:.1f} us per step of {spans_per_step} spans = "
        f"{100 * recording / off_step:.3f}% of a step"
    )
    print(
        f"2. epoch-end work per step (median of {len(epoch_end_work)} epochs): "
        f"{1e3 * epoch_end:.3f} ms = {100 * epoch_end / off_step:.2f}% of a step"
    )
    print(
        f"   once per fit (medians): first epoch end {1e3 * median(first_epoch_end_work):.0f} ms "
        f"(traces the scalar writers), end of fit {1e3 * median(end_of_fit):.0f} ms "
        "(summary, timeline, Gantt chart)"
    )
    print(
        f"3. whole fits, per step of epochs 2-{args.epochs} (median of {args.rounds}): "
        f"off {1e3 * off_fit:.3f} ms, on {1e3 * on_fit:.3f} ms, on/off {on_fit / off_fit:.4f}"
    )
    print(
        f"4. profiling off: no-op span {1e9 * span:.0f} ns x {spans_per_step} per step = "
        f"{1e6 * span * spans_per_step:.2f} us = {100 * span * spans_per_step / off_step:.4f}% "
        "of a step"
    )
    print(f"profiles written under {root}")


if __name__ == "__main__":
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:  # no launcher
        sys.exit(_relaunch_under_mpirun())
    main()
