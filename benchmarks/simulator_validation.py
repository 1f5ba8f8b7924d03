"""Scaling model against real runs: predicted vs measured step time at 1, 2 and 4 ranks.

Run: .venv/bin/python benchmarks/simulator_validation.py [--models mlp,cnn] [--rounds 3]
     (starts mpirun itself; takes about 10 minutes per model on 2 cores)

For each model (an MLP and a small ResNet-style CNN, steps of tens of milliseconds):

1. calibrate, each in fresh processes with one TensorFlow thread like the training ranks:
   the network (`hyparflow.simulate.netbench`, mpi4py ping-pong and allreduce, the engine's
   own transfers, on 2 ranks), then the model's per-layer and engine costs
   (`hyparflow.simulate.measure`, one process on one core), the one-rank `model.fit`
   baseline, and the co-run factor and jitter: one short data-parallel run on 2 ranks at
   half the batch (not a validated configuration), its compute and optimizer time against
   the prediction of the same parts (a job with every core busy runs 10-30% slower here than
   one process alone, for reasons the one-process measurement cannot see), and its
   allreduce beyond the prediction: the replicas waiting for each other, from which the
   per-step variation of a rank's compute (`Machine.jitter`) follows; the factor splits
   into the co-run state those runs read (below) and the engine's own part;
2. predict one rank (plain model.fit), data parallel 1x2 and 1x4, model parallel 2x1 and 4x1,
   hybrid 2x2 (P partitions x R replicas) with the simulator, on 2 cores;
3. measure the same configurations with `hf.fit` under `mpirun` (verbose=0, callbacks that
   read no batch logs, no profiler: the loop shares the logs once an epoch; step time: from
   one step's start to the next on each rank, what a user's samples/s pays, mean over the
   ranks, the first (traced) epoch left out), rounds interleaved so that a
   busy spell on the shared machine hits every configuration alike, and take the median;
   the pipelines use the simulator's stage split (passed as explicit layer names);
   every multi-rank run also reads its co-run state inside the run (one rank per core times
   the speed probe's step at once, at the timed epochs' start and after the last step, over
   the probe's reading alone: the host's placement of the vCPUs, which holds while every
   core is busy), and is predicted with `corun` = the engine's part times that state;
4. print measured vs predicted and the relative error, and write everything to a JSON file
   (benchmarks/simulator_validation.json by default).

The machine is shared with other engineers' jobs, which take an unknown, changing part of its
two cores and make a step up to twice as slow. The model describes a dedicated machine, so
the driver measures on one: before every run it waits until the machine is idle (under 15% of
the cores busy over 2 s, /proc/stat), and each rank records the CPU time it got over the wall
time of the timed epochs. Their sum is the number of cores the job had ("cores got"; ranks
poll while they wait for MPI, so an undisturbed job takes min(ranks, cores)). A run that got
less than 93% of that shared the machine with someone else: it is discarded and repeated (up
to --tries times; the count is reported). The calibration is checked the same way (its one
process must have got 90% of core 0, which also serves the VM's interrupts). The machine's
speed also drifts by tens of percent over minutes with nothing visible in it (other tenants
of the host share its caches and memory; a calibration once ran 64% slower than the runs
right after it). So a speed probe stays resident for each model: one process on core 0 that
sleeps until asked, then times the model's fused engine step for 1.5 s (`SpeedProbe`). It is
read before and after the calibration and every run; a calibration or run whose two readings
differ by more than 8% (the speed moved during it) is repeated like a disturbed one, and
each prediction uses the round's costs rescaled by the probe's mean around that run over its
mean around the calibration (`ModelCosts.scaled`): the costs the machine had when the run
ran, as a fresh calibration right before it would give. Every round also starts with a fresh
calibration (network, then each model's costs). The error reported per configuration
compares the median prediction with the median measurement over the rounds (the median of
the paired per-round errors and the error without the rescaling are printed too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
from benchmarks.harness.launch import MPI_ENV, thread_env  # noqa: E402
from benchmarks.harness.quiet import busy_fraction  # noqa: E402

ENV = {
    **MPI_ENV,
    **thread_env(1),
    # glibc hands TensorFlow's large temporaries (> 128 KiB) out by mmap and back by munmap,
    # so every step faults their pages in again; two ranks doing so at once on this VM slowed
    # each other 2.3x (the CNN). Keeping them in the heap removes that (docs/simulate.md).
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 31),
}
CONFIGS = [(1, 1), (1, 2), (1, 4), (2, 1), (4, 1), (2, 2)]  # (partitions, replicas)
CORES = os.cpu_count() or 1
PROBE_BATCH = 64  # samples per fused step of the speed probe
PROBE_SECONDS = 1.5  # per probe reading
STATE_SECONDS = 1.0  # per in-run reading of the co-run state
STATE_SLACK = 0.25  # s the idle ranks sleep beyond a state reading (a step may overrun it)
TIMESLICE_SECONDS = 4.0  # per window when measuring the switching cost
TIMESLICE_WINDOWS = 5  # alone, shared, alone, shared, alone
TIMESLICE_WARMUP = 12.0  # seconds for the copies to start and trace before they are timed
CORUN_EPOCHS = 8  # per co-run run: the first traces, the other 7 x 12 steps are timed
CORUN_TRIES = 3  # co-run runs per calibration, the median kept
STEADY = 0.08  # largest change of speed between the probes around an accepted run
# least share of core 0 an accepted calibration got: on this VM a calibration alone on an
# idle machine gets 0.92-0.94 of it (core 0 also serves the VM's interrupts); the probes
# around it catch a slowed machine
CALIBRATION_SHARE = 0.90


def _arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per configuration")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4, help="for pipelines")
    parser.add_argument("--steps", type=int, default=12, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=8,
                        help="per run; the first traces, the rest are timed")  # fmt: skip
    parser.add_argument(
        "--profiled", action="store_true", help="(worker) run the ScalingProfiler too"
    )
    parser.add_argument(
        "--corun-state", action="store_true",
        help="(worker) read the co-run state before the timed epochs and after the last step",
    )  # fmt: skip
    parser.add_argument(
        "--tries", type=int, default=6, help="runs before accepting a disturbed one"
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "simulator_validation.json"))
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "CONFIG", "LOG_DIR", "STARTS"))
    parser.add_argument("--calibrate", nargs=2, metavar=("MODEL", "COSTS"))
    parser.add_argument("--calibrate-fit", nargs=2, metavar=("MODEL", "COSTS"))
    parser.add_argument("--probe", metavar="MODEL")
    parser.add_argument("--timeslice-probe", nargs=3, metavar=("MODEL", "START_AT", "ROLE"))
    return parser.parse_args(argv)


# --- models -----------------------------------------------------------------------------------


def build_model(kind: str):
    """The two validation models (seeded): an MLP and a small pre-activation ResNet."""
    import keras

    keras.utils.set_random_seed(0)
    if kind == "mlp":
        inputs = keras.Input((256,), name="features")
        x = inputs
        for i in range(6):
            x = keras.layers.Dense(512, activation="relu", name=f"dense_{i}")(x)
        outputs = keras.layers.Dense(10, activation="softmax", name="classes")(x)
    elif kind == "cnn":
        inputs = keras.Input((16, 16, 3), name="images")
        x = keras.layers.Conv2D(16, 3, padding="same", name="stem")(inputs)
        for stage, width in enumerate((16, 32, 64)):
            for block in range(2):
                stride = 2 if stage > 0 and block == 0 else 1
                name = f"s{stage}b{block}"
                y = keras.layers.BatchNormalization(name=f"{name}_bn1")(x)
                y = keras.layers.Activation("relu", name=f"{name}_relu1")(y)
                y = keras.layers.Conv2D(width, 3, strides=stride, padding="same",
                                        name=f"{name}_conv1")(y)  # fmt: skip
                y = keras.layers.BatchNormalization(name=f"{name}_bn2")(y)
                y = keras.layers.Activation("relu", name=f"{name}_relu2")(y)
                y = keras.layers.Conv2D(width, 3, padding="same", name=f"{name}_conv2")(y)
                if stride != 1 or x.shape[-1] != width:
                    x = keras.layers.Conv2D(width, 1, strides=stride, name=f"{name}_proj")(x)
                x = keras.layers.Add(name=f"{name}_add")([x, y])
        x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
        outputs = keras.layers.Dense(10, activation="softmax", name="classes")(x)
    else:
        raise ValueError(f"unknown model {kind!r}: use mlp or cnn")
    model = keras.Model(inputs, outputs, name=f"validation_{kind}")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def _data(model, samples: int):
    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.normal(size=(samples, *model.input_shape[1:])).astype("float32")
    return x, rng.integers(0, 10, size=samples)


# --- what runs under mpirun ---------------------------------------------------------------------


def worker(args) -> None:
    """One measured run: hf.fit, with the ScalingProfiler on every rank if `--profiled`.

    The validated runs go without it: its per-step breakdown needs the steps kept apart, so it
    makes the loop share the logs after every batch (three small collectives), which a job
    whose callbacks read no batch logs does not pay (docs/engine.md, "Logs")."""
    import keras

    import hyparflow as hf

    keras.config.disable_interactive_logging()
    model_path, config, log_dir, starts = args.worker
    partitions, replicas, microbatches = (int(v) for v in config.split("x"))
    model = keras.saving.load_model(model_path)
    x, y = _data(model, args.batch_size * args.steps)
    kind = "data" if partitions == 1 else ("model" if replicas == 1 else "hybrid")
    strategy = hf.Strategy(
        kind,
        partitions=partitions,
        replicas=replicas,
        microbatches=microbatches,
        schedule="1f1b",
        balance=starts.split(",") if starts != "-" else "layers",
    )
    callbacks = [_cpu_share_callback(), _step_period_callback()]
    share, period = callbacks
    if args.profiled:
        callbacks.append(hf.callbacks.ScalingProfiler(log_dir, timeline=False,
                                                      batch_size=args.batch_size))  # fmt: skip
    state = []
    if args.corun_state:
        # first at the timed epochs' start (before the other callbacks start their clocks),
        # last at the end (after they stopped them)
        first, last = _corun_state_callbacks(model_path, state)
        callbacks = [first, *callbacks, last]
    os.makedirs(log_dir, exist_ok=True)
    hf.fit(model, x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
           strategy=strategy, callbacks=callbacks)  # fmt: skip
    with open(os.path.join(log_dir, f"cpu_share_{hf.rank()}.json"), "w") as f:
        json.dump({"cpu_share": share.share, "step_period": statistics.mean(period.periods),
                   "corun_state_s": state or None}, f)  # fmt: skip


def _step_period_callback():
    """Seconds from each step's start to the next within an epoch, from the second epoch
    (the first traces): what a step costs the job, the loop's work between steps included."""
    import keras

    class StepPeriod(keras.callbacks.Callback):
        needs_batch_logs = False  # it reads a clock, not the logs

        def __init__(self):
            super().__init__()
            self.periods, self._start = [], None

        def on_epoch_begin(self, epoch, logs=None):
            self._start, self._timed = None, epoch >= 1

        def on_train_batch_begin(self, batch, logs=None):
            now = time.perf_counter()
            if self._timed and self._start is not None:
                self.periods.append(now - self._start)
            self._start = now

    return StepPeriod()


def probing_ranks(affinities: list[list[int]], cores: int) -> list[int]:
    """The ranks that read the co-run state, one per core: each rank pinned to a core no
    lower rank is pinned to; when none is pinned (no more ranks than cores), the first
    `cores` ranks.

    >>> probing_ranks([[0, 1], [0, 1]], 2)
    [0, 1]
    >>> probing_ranks([[0], [1], [0], [1]], 2)  # hyparflow pinned a crowded job
    [0, 1]
    >>> probing_ranks([[1], [1], [0], [0]], 2)
    [0, 2]
    """
    chosen, taken = [], set()
    for rank, allowed in enumerate(affinities):
        if len(allowed) == 1 and allowed[0] not in taken:
            chosen.append(rank)
            taken.add(allowed[0])
    return chosen or list(range(min(cores, len(affinities))))


def _corun_state_callbacks(model_path: str, readings: list):
    """Two callbacks that read the co-run state inside the run: at the start of the timed
    epochs and after the last step, one rank per core times the speed probe's step for
    STATE_SECONDS while the others sleep; each appends its median seconds (None when it
    slept) to `readings`. Every core stays busy from the first reading to the last, so the
    host keeps the placement the steps ran with (docs/simulate.md, "The co-run state")."""
    import keras
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    step = _saved_model_step(model_path, PROBE_BATCH)
    step()  # traces

    def read() -> None:
        affinities = comm.allgather(sorted(os.sched_getaffinity(0)))
        deadline = comm.bcast(time.time() + STATE_SECONDS)
        if comm.Get_rank() in probing_ranks(affinities, CORES):
            readings.append(median_step_seconds(step, deadline, time.time))
        else:
            time.sleep(max(0.0, deadline + STATE_SLACK - time.time()))
            readings.append(None)
        comm.Barrier()

    class AtStart(keras.callbacks.Callback):
        needs_batch_logs = False

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                read()

    class AtEnd(keras.callbacks.Callback):
        needs_batch_logs = False

        def on_train_end(self, logs=None):
            read()

    return AtStart(), AtEnd()


def _cpu_share_callback():
    """Fraction of a core this process got from the second epoch (traced once) to the end."""
    import keras

    class CpuShare(keras.callbacks.Callback):
        share = None

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.start = (time.process_time(), time.perf_counter())

        def on_train_end(self, logs=None):
            cpu, wall = time.process_time(), time.perf_counter()
            self.share = (cpu - self.start[0]) / (wall - self.start[1])

    return CpuShare()


def calibrate(args) -> None:
    """Measure the model's costs in this (one-thread) process."""
    import keras

    from hyparflow.simulate.measure import measure_model

    model_path, costs_path = args.calibrate
    model = keras.saving.load_model(model_path)
    one_rank = (args.batch_size // 2, args.batch_size)  # the sizes the single rank trains at
    measure_model(model, batch_sizes=(32, 128), fit_batch_sizes=one_rank).save(costs_path)


def calibrate_fit(args) -> None:
    """Replace the costs' one-rank baseline by one measured with the machine to itself."""
    import keras

    from hyparflow.simulate import ModelCosts
    from hyparflow.simulate.measure import fit_step

    model_path, costs_path = args.calibrate_fit
    costs = ModelCosts.load(costs_path)
    model = keras.saving.load_model(model_path)
    started = (time.process_time(), time.perf_counter())
    costs.single_process = fit_step(model, (args.batch_size // 2, args.batch_size))
    share = (time.process_time() - started[0]) / (time.perf_counter() - started[1])
    costs.measured["single_process_cpu_share"] = share
    costs.save(costs_path)


def _saved_model_step(model_path: str, batch: int):
    """The saved model's fused engine step on `batch` samples, as a callable."""
    import keras

    from hyparflow.partitioner import profile
    from hyparflow.partitioner.graph import build_graph
    from hyparflow.simulate.measure import fused_step

    model = keras.saving.load_model(model_path)
    return fused_step(model, profile.make_sample(build_graph(model), batch_size=batch))


def median_step_seconds(step, deadline: float, clock) -> float:
    """Median seconds of `step()` called back to back until `clock()` passes `deadline`
    (at least 5 calls): the speed probe's reading, and the co-run state's."""
    seconds = []
    while len(seconds) < 5 or clock() < deadline:
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def probe_server(model_path: str) -> None:
    """`--probe MODEL`: for each line on stdin, time the model's fused engine step for about
    PROBE_SECONDS and print the median seconds: the machine's speed at that moment."""
    step = _saved_model_step(model_path, PROBE_BATCH)
    step()  # traces
    print("ready", flush=True)
    for _ in sys.stdin:
        deadline = time.perf_counter() + PROBE_SECONDS
        print(median_step_seconds(step, deadline, time.perf_counter), flush=True)


def timeslice_probe(args) -> None:
    """`--timeslice-probe MODEL START_AT ROLE`: run the model's fused engine step at the
    pipelines' micro-batch size in TIMESLICE_WINDOWS windows of TIMESLICE_SECONDS from the
    wall-clock time START_AT. The "host" computes through all of them and prints its
    processor seconds per step in each (JSON); the "guest" computes through every second
    one only, so that the host's core alternates between one computing rank and two."""
    model_path, start_at, role = args.timeslice_probe
    step = _saved_model_step(model_path, args.batch_size // args.microbatches)
    for _ in range(10):
        step()  # traces, warms the caches
    per_step = []
    for window in range(TIMESLICE_WINDOWS):
        begin = float(start_at) + window * TIMESLICE_SECONDS
        end = begin + TIMESLICE_SECONDS
        if role == "guest" and window % 2 == 0:
            continue
        time.sleep(max(0.0, begin - time.time()))
        steps, cpu = 0, time.process_time()
        while time.time() < end:
            step()
            steps += 1
        per_step.append((time.process_time() - cpu) / steps)
    if role == "host":
        print(json.dumps(per_step), flush=True)


def timeslice_factor(args, model_path: str) -> dict:
    """How much more processor time the model's step takes while its core switches between
    it and another computing rank (`Machine.timeslice`): one copy of the step computes on
    core 0 throughout while a second joins it there in every other window (the other core
    idle); the first copy's processor time per step in the shared windows over that in
    the windows alone. One process against itself, interleaved, so that neither the
    machine's drift nor two processes' different memory tells in the ratio."""
    wait_for_quiet()
    start_at = time.time() + TIMESLICE_WARMUP

    def start(role: str) -> subprocess.Popen:
        command = ["taskset", "-c", "0", sys.executable, __file__, "--timeslice-probe",
                   model_path, str(start_at), role, "--batch-size", str(args.batch_size),
                   "--microbatches", str(args.microbatches)]  # fmt: skip
        return subprocess.Popen(command, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)  # fmt: skip

    processes = {role: start(role) for role in ("host", "guest")}
    outputs = {role: p.communicate(timeout=300)[0] for role, p in processes.items()}
    per_step = json.loads(outputs["host"].strip().splitlines()[-1])
    alone, shared = per_step[0::2], per_step[1::2]
    factor = statistics.mean(shared) / statistics.mean(alone)
    return {"timeslice": max(1.0, factor), "alone_s": alone, "shared_s": shared}


class SpeedProbe:
    """A resident one-thread process on core 0 that times the model's fused step on request.

    It sleeps between requests, so it takes nothing from the runs it brackets; being one
    process throughout, its readings differ only by the machine's speed."""

    def __init__(self, model_path: str):
        self.process = subprocess.Popen(
            ["taskset", "-c", "0", sys.executable, __file__, "--probe", model_path],
            env={**os.environ, **ENV}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        for line in self.process.stdout:
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"the speed probe for {model_path} exited before it was ready")

    def seconds(self) -> float:
        """Median seconds of one fused step now (on an otherwise idle machine)."""
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def corun_state(readings: list[list[float | None]], alone: float) -> list[float]:
    """The co-run state at a run's start and end: the probe step's seconds on the ranks that
    read it (one per core, all at once; `readings[rank]`, None where the rank slept) over
    its seconds with the machine otherwise idle (`alone`, the speed probe around the run).

    >>> corun_state([[1.25, 1.5], [None, None], [1.75, 1.5]], 2.0)
    [0.75, 0.75]
    """
    return [statistics.mean(r[i] for r in readings if r[i] is not None) / alone for i in range(2)]


def corun_of_run(calibrated: dict, state: list[float] | None) -> float:
    """The co-run factor for a run whose cores were in co-run state `state`: the engine's
    share of the calibration's factor (`engine`, its factor over its own run's state) times
    the state; without a state (one rank), the calibration's factor.

    >>> round(corun_of_run({"corun": 1.37, "engine": 1.1}, [1.0, 1.02]), 3)
    1.111
    >>> corun_of_run({"corun": 1.37, "engine": 0.95}, [1.0, 1.0])  # never below alone
    1.0
    """
    if state is None:
        return calibrated["corun"]
    return max(1.0, calibrated["engine"] * statistics.mean(state))


def steady(before: float, after: float) -> bool:
    """Whether the machine's speed held over a run: the probes around it agree within
    STEADY."""
    return abs(after / before - 1.0) <= STEADY


# --- the driver ---------------------------------------------------------------------------------


def wait_for_quiet(limit: float = 0.15, patience: float = 1200) -> float:
    """Wait (up to `patience` s) until under `limit` of the machine is busy; returns the last
    reading."""
    deadline = time.monotonic() + patience
    busy = busy_fraction()
    while busy >= limit and time.monotonic() < deadline:
        busy = busy_fraction()
    return busy


def _run(command: list[str], timeout: float = 900) -> None:
    result = subprocess.run(
        command, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")


def measure_config(args, model_path, config, starts, folder, probe, profiled=False) -> dict:
    partitions, replicas, microbatches = config
    log_dir = os.path.join(folder, f"{partitions}x{replicas}-{time.monotonic_ns()}")
    label = f"{partitions}x{replicas}x{microbatches}"
    worker_args = [sys.executable, __file__, "--worker", model_path, label, log_dir,
                   ",".join(starts) or "-", "--batch-size", str(args.batch_size),
                   "--steps", str(args.steps), "--epochs", str(args.epochs),
                   *(["--profiled"] if profiled else [])]  # fmt: skip
    world = partitions * replicas
    if world > 1:
        worker_args.append("--corun-state")
    if world == 1:
        command = worker_args
    else:
        command = ["mpirun", "-np", str(world), "--bind-to", "none", *worker_args]
    wait_for_quiet()
    before = probe.seconds()
    _run(command)
    after = probe.seconds()
    shares, periods, states = [], [], []
    for rank in range(world):
        with open(os.path.join(log_dir, f"cpu_share_{rank}.json")) as f:
            recorded = json.load(f)
        shares.append(recorded["cpu_share"])
        periods.append(recorded["step_period"])
        if recorded.get("corun_state_s"):
            states.append(recorded["corun_state_s"])
    result = {
        "step_ms": 1e3 * statistics.mean(periods),
        "parts_ms": {},
        "bubble": None,
        "cores_got": min(float(CORES), sum(shares)),
        "cpu_shares": shares,
        "probe_s": [before, after],
        "corun_state": corun_state(states, (before + after) / 2) if states else None,
    }
    if profiled:
        with open(os.path.join(log_dir, "profile.json")) as f:
            profile = json.load(f)
        job = profile["job"]
        result.update(
            profiler_step_ms=job["ms_per_step"]["step"],
            parts_ms={k: v for k, v in job["ms_per_step"].items() if v is not None},
            bubble=job.get("bubble_measured"),
            steps=profile["steps"]["summarized"],
        )
    return result


def main(argv=None) -> None:
    args = _arguments(argv)
    if args.worker:
        return worker(args)
    if args.calibrate:
        return calibrate(args)
    if args.calibrate_fit:
        return calibrate_fit(args)
    if args.probe:
        return probe_server(args.probe)
    if args.timeslice_probe:
        return timeslice_probe(args)
    from hyparflow.simulate import Layout, Machine, predict

    folder = tempfile.mkdtemp(prefix="hf-simulator-validation-")
    kinds = args.models.split(",")
    layouts = {(p, r): Layout(p, r, args.microbatches if p > 1 else 1, "1f1b") for p, r in CONFIGS}
    runs = {kind: {key: [] for key in layouts} for kind in kinds}
    report = {"machine": {"cores": CORES}, "args": vars(args), "rounds": []}
    for kind in kinds:
        _save_model(kind, os.path.join(folder, f"{kind}.keras"))
    probes = {kind: SpeedProbe(os.path.join(folder, f"{kind}.keras")) for kind in kinds}
    for round_ in range(args.rounds):
        # the machine's speed drifts (other tenants): calibrate again in every round and
        # compare each measurement with the prediction of its own round
        network = network_quietly(folder, args.tries)
        print(f"round {round_} network: {network.intra}, reduce {network.reduce_rate:.3g} B/s, "
              f"send {network.overhead * 1e6:.0f} us, handoff {network.handoff * 1e6:.0f} us",
              flush=True)  # fmt: skip
        record = {"network": network.to_dict(), "costs": {}}
        for kind in kinds:
            model_path = os.path.join(folder, f"{kind}.keras")
            costs_path = os.path.join(folder, f"{kind}.json")
            probe = probes[kind]
            costs = calibrate_quietly(args, model_path, costs_path, network, folder, probe)
            record["costs"][kind] = costs.to_dict()
            order = CONFIGS if round_ % 2 == 0 else CONFIGS[::-1]
            for key in order:
                layout = layouts[key]
                calibrated = costs.measured["corun"]
                machine = Machine(
                    CORES,
                    corun=calibrated["corun"],
                    jitter=calibrated["jitter"],
                    timeslice=costs.measured["timeslice"]["timeslice"],
                )
                planned = predict(costs, network, layout, args.batch_size, machine)
                config = (layout.partitions, layout.replicas, layout.microbatches)
                result = measure_quietly(args, model_path, config, planned.stage_names, folder,
                                         probe)  # fmt: skip
                # the costs at the machine's speed around this run (same stage split), the
                # co-run factor for the state its cores were in
                speed = speed_of(result, costs)
                corun = corun_of_run(calibrated, result["corun_state"])
                p = predict(costs.scaled(speed), network, layout, args.batch_size,
                            replace(machine, corun=corun), starts=planned.stage_starts)  # fmt: skip
                result.update(
                    round=round_,
                    speed=speed,
                    corun=corun,
                    predicted_ms=p.step_time * 1e3,
                    predicted_at_calibration_ms=planned.step_time * 1e3,
                    predicted_parts_ms={
                        "pipeline": p.pipeline_time * 1e3,
                        "allreduce": p.allreduce_time * 1e3,
                        "optimizer": p.optimizer_time * 1e3,
                        "between_steps": p.between_steps_time * 1e3,
                    },
                    bubble_predicted=p.bubble,
                    stage_names=p.stage_names,
                )
                runs[kind][key].append(result)
                print(f"{kind} {key[0]}x{key[1]} round {round_}: measured "
                      f"{result['step_ms']:.2f} ms, predicted {result['predicted_ms']:.2f} ms "
                      f"(speed {speed:.2f}, co-run {corun:.2f}, "
                      f"cores got {result['cores_got']:.2f}, "
                      f"attempt {result['attempts']})",
                      flush=True)  # fmt: skip
        report["rounds"].append(record)
    for probe in probes.values():
        probe.close()
    report["models"] = {kind: _rows(runs[kind], layouts) for kind in kinds}
    for kind in kinds:
        print(_table(kind, report["models"][kind], args.batch_size))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"written: {args.out}")


def _rows(runs: dict, layouts: dict) -> list[dict]:
    rows = []
    for key, layout in layouts.items():
        results = runs[key]
        errors = [r["predicted_ms"] / r["step_ms"] - 1 for r in results]
        rows.append({
            "partitions": key[0], "replicas": key[1], "microbatches": layout.microbatches,
            "measured_ms": statistics.median(r["step_ms"] for r in results),
            "predicted_ms": statistics.median(r["predicted_ms"] for r in results),
            # the headline: the medians compared (both are noisy samples of one quantity)
            "error": statistics.median(r["predicted_ms"] for r in results)
            / statistics.median(r["step_ms"] for r in results) - 1,
            "paired_error": statistics.median(errors),
            # the same with the costs as calibrated, not rescaled to the speed around the run
            "error_at_calibration": statistics.median(
                r["predicted_at_calibration_ms"] for r in results
            ) / statistics.median(r["step_ms"] for r in results) - 1,
            "speed_all": [r["speed"] for r in results],
            "corun_all": [r["corun"] for r in results],
            "corun_state_all": [r["corun_state"] for r in results],
            "errors": errors,
            "measured_ms_all": [r["step_ms"] for r in results],
            "predicted_ms_all": [r["predicted_ms"] for r in results],
            "cores_got_all": [r["cores_got"] for r in results],
            "attempts": [r["attempts"] for r in results],
            "measured_parts_ms": _median_parts(results),
            "predicted_parts_ms": {
                part: statistics.median(r["predicted_parts_ms"][part] for r in results)
                for part in results[0]["predicted_parts_ms"]
            },
            "bubble_measured": _median_or_none([r["bubble"] for r in results]),
            "bubble_predicted": statistics.median(r["bubble_predicted"] for r in results),
        })  # fmt: skip
    return rows


def _median_or_none(values):
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def network_quietly(folder: str, tries: int):
    """The network measured while its two ranks had both cores (again if they had not)."""
    from hyparflow.simulate import Network
    from hyparflow.simulate.netbench import launch

    for attempt in range(tries):
        wait_for_quiet()
        data = launch(os.path.join(folder, "network.json"))
        cores_got = data["source"]["cores_got"]
        print(f"network {attempt}: cores got {cores_got:.2f}", flush=True)
        if cores_got >= 0.93 * min(2, CORES):
            break
    data["source"]["attempts"] = attempt + 1
    return Network.from_dict(data)


def calibrate_quietly(args, model_path: str, costs_path: str, network, folder: str, probe):
    """Measure the costs as one rank has them (one core, `measure.py`) and the one-rank
    baseline, again while someone else's job shared the machine (the process got under 90%
    of its core) or the machine's speed moved (the probes around it disagree); then the
    co-run factor (`corun_factor`). The probes' mean is the speed the costs hold at."""
    from hyparflow.simulate import ModelCosts

    for attempt in range(args.tries):
        wait_for_quiet()
        before = probe.seconds()
        _run(["taskset", "-c", "0", sys.executable, __file__, "--calibrate", model_path,
              costs_path, "--batch-size", str(args.batch_size)])  # fmt: skip
        wait_for_quiet()
        _run(["taskset", "-c", "0", sys.executable, __file__, "--calibrate-fit", model_path,
              costs_path, "--batch-size", str(args.batch_size)])  # fmt: skip
        after = probe.seconds()
        costs = ModelCosts.load(costs_path)
        share = costs.measured["cpu_share"]
        print(f"calibration {attempt}: cpu share {share:.2f}, probes {before * 1e3:.1f} "
              f"{after * 1e3:.1f} ms", flush=True)  # fmt: skip
        if share >= CALIBRATION_SHARE and steady(before, after):
            break
    costs.measured["calibration_attempts"] = attempt + 1
    costs.measured["probe_s"] = (before + after) / 2
    costs.measured["probe_pair_s"] = [before, after]
    costs.measured["corun"] = corun_factor(args, model_path, costs, network, folder, probe)
    costs.measured["timeslice"] = timeslice_factor(args, model_path)
    print(f"co-run factor {costs.measured['corun']['corun']:.2f} "
          f"(engine {costs.measured['corun']['engine']:.2f}, "
          f"state {costs.measured['corun']['state']:.2f}), "
          f"jitter {costs.measured['corun']['jitter']:.3f}, "
          f"timeslice {costs.measured['timeslice']['timeslice']:.2f}", flush=True)  # fmt: skip
    return costs


def speed_of(result: dict, costs) -> float:
    """How much longer the machine's kernels took around a run than at the calibration."""
    return statistics.mean(result["probe_s"]) / costs.measured["probe_s"]


def corun_factor(args, model_path, costs, network, folder, probe) -> dict:
    """How much slower the engine's processor work runs in a job with every core busy than
    the one-process calibration says: a data-parallel run on two ranks at half the
    validation batch (a configuration not validated), its compute and optimizer time per
    rank against the prediction of the same parts. Several effects the one-process
    measurement cannot see land in it; docs/simulate.md says what was tried. The median of
    CORUN_TRIES runs of CORUN_EPOCHS epochs each, factor and jitter apart: another core's
    load slows this one by 0-20% from one few-second window to the next here, and runs of
    2 epochs (a second of steps) read 1.01-1.57 a minute apart where runs of 8 read
    0.98-1.13."""
    runs = [_corun_once(args, model_path, costs, network, folder, probe)
            for _ in range(CORUN_TRIES)]  # fmt: skip
    middle = sorted(runs, key=lambda run: run["engine"])[len(runs) // 2]
    return {
        **middle,
        "jitter": statistics.median(run["jitter"] for run in runs),
        "tries": [run["corun"] for run in runs],
        "engines": [run["engine"] for run in runs],
        "states": [run["state"] for run in runs],
        "jitters": [run["jitter"] for run in runs],
    }


def _corun_once(args, model_path, costs, network, folder, probe) -> dict:
    from hyparflow.simulate import Layout, Machine, predict
    from hyparflow.simulate.predict import expected_maximum

    small = argparse.Namespace(**{**vars(args), "batch_size": args.batch_size // 2,
                                  "epochs": CORUN_EPOCHS})  # fmt: skip
    result = measure_quietly(small, model_path, (1, 2, 1), [], folder, probe, profiled=True)
    parts = result["parts_ms"]
    measured = parts["compute"] + parts["optimizer"]
    speed = speed_of(result, costs)
    p = predict(costs.scaled(speed), network, Layout(1, 2), small.batch_size, Machine(CORES))
    predicted = (p.stage_compute[0] + p.optimizer_time) * 1e3
    # the same run's allreduce (mean over ranks) beyond the model's is the wait for the
    # other replica: E[max of 2] - mean = 0.56 sigma of a rank's step (Machine.jitter)
    wait = max(0.0, parts["allreduce"] - p.allreduce_time * 1e3)
    jitter = wait / (expected_maximum(2) * parts["compute"])
    # the host's placement of the cores (the co-run state) comes and goes between runs; the
    # rest of the factor is the engine's own, carried to runs in other states
    state = statistics.mean(result["corun_state"])
    return {"corun": max(1.0, measured / predicted), "engine": measured / predicted / state,
            "state": state, "measured_ms": measured, "predicted_ms": predicted,
            "batch_size": small.batch_size, "jitter": jitter, "allreduce_wait_ms": wait,
            "speed": speed}  # fmt: skip


def measure_quietly(args, model_path, config, starts, folder, probe, profiled=False) -> dict:
    """A run on an otherwise idle machine whose speed held: repeated while it got too few
    cores or the probes around it disagree. `speed`: the probes' mean over the calibration's."""
    expected = min(config[0] * config[1], CORES)
    attempts = 0
    while True:
        attempts += 1
        result = measure_config(args, model_path, config, starts, folder, probe, profiled)
        quiet = result["cores_got"] >= 0.93 * expected
        # the host may move the cores between the state's readings (rare while all are busy)
        held = result["corun_state"] is None or steady(*result["corun_state"])
        if (quiet and held and steady(*result["probe_s"])) or attempts >= args.tries:
            result["attempts"] = attempts
            return result


def _save_model(kind: str, path: str) -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.simulator_validation "
        f"import build_model; build_model({kind!r}).save({path!r})"
    )
    _run([sys.executable, "-c", code])


def _median_parts(runs) -> dict:
    keys = runs[0]["parts_ms"].keys()  # (none for unprofiled runs)
    return {k: statistics.median(r["parts_ms"][k] for r in runs) for k in keys}


def _table(kind: str, rows: list[dict], batch: int) -> str:
    lines = [
        f"\n{kind}: global batch {batch}, 1F1B, {CORES} cores; step = ms from one step's "
        "start to the next (ranks' mean); medians over rounds (each round calibrated afresh); "
        "error = median predicted / median measured - 1, predictions from costs rescaled to the "
        "machine's speed around each run (speed probe); uncorr. = the same from the costs as "
        "calibrated",
        f"{'P x R':>6} {'M':>3} {'measured':>9} {'range':>13} {'predicted':>10} "
        f"{'range':>13} {'error':>7} {'uncorr.':>7}   paired errors per round (median)",
    ]
    for r in rows:
        low, high = min(r["measured_ms_all"]), max(r["measured_ms_all"])
        p_low, p_high = min(r["predicted_ms_all"]), max(r["predicted_ms_all"])
        per_round = " ".join(f"{e:+.0%}" for e in r["errors"])
        lines.append(
            f"{r['partitions']:>2} x {r['replicas']:<2} {r['microbatches']:>3} "
            f"{r['measured_ms']:>9.2f} {f'{low:.1f}-{high:.1f}':>13} {r['predicted_ms']:>10.2f} "
            f"{f'{p_low:.1f}-{p_high:.1f}':>13} {r['error']:>+7.1%} "
            f"{r['error_at_calibration']:>+7.1%}   {per_round} "
            f"({r['paired_error']:+.0%})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
