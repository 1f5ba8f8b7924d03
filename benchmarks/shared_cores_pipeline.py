"""Ranks short of cores: a synthetic pipeline against the scaling model's shared-core schedule.

Run: .venv/bin/python benchmarks/shared_cores_pipeline.py [--ranks 4] [--sizes 1,2,4]
     (starts mpirun itself; about 2 minutes on 2 cores)

Isolates the part of `hyparflow simulate` that runs a pipeline on a node with more ranks than
cores (`simulate/sharing.py`) from everything else the model has to get right. Each rank walks
the engine's 1F1B schedule (`engine.schedule`) for P stages and 4 micro-batches: it receives
a 16 KiB message from its neighbour with a blocking `Recv` (Open MPI polls, as the engine
waits), does a fixed amount of work (backward twice the forward), and sends with `Isend`.
The work is either

- `python`: a loop of the rank's own thread that runs until it has used the given CPU time,
  one thread per rank, so the model's assumptions hold by construction; or
- `tf`: a compiled TensorFlow call (a chain of 64 x 512 matmuls) sized to take that time,
  which TensorFlow runs on its compute thread while the Python thread sleeps, as every engine
  call does;

each with the ranks unpinned (`mpirun --bind-to none`, the kernel places threads) and pinned
the way `hf.fit` pins them (`hyparflow.launch.affinity`). The step is the median over 20 steps
(the first 3 left out) of rank 0's time from one step's start to the next (steps end with a
barrier). The prediction is `shared_pipeline` with each action's time measured in one
process on one core, waiting ranks' idle share 0, no message delay; "pinned" predictions use
the pinned placement, "unpinned" ones the average over even placements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
from benchmarks.harness.launch import MPI_ENV, thread_env  # noqa: E402

MICROBATCHES = 4
STEPS = 20
MATMULS_PER_CALL_PROBE = (10, 100)


def _arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="pipeline stages, one rank each")
    parser.add_argument("--sizes", default="1,2,4", help="forward work per action, ms")
    parser.add_argument("--worker", nargs=4, metavar=("WORK", "PIN", "FORWARD_MS", "RATE"))
    parser.add_argument("--calibrate", action="store_true", help="(worker) time the TF call")
    return parser.parse_args(argv)


def _tf_chunk():
    import tensorflow as tf

    weights = tf.Variable(tf.random.stateless_normal((512, 512), seed=(1, 2)) * 0.04)
    inputs = tf.random.stateless_normal((64, 512), seed=(3, 4))

    @tf.function
    def chunk(count):
        x = inputs
        for _ in tf.range(count):
            x = tf.tanh(tf.matmul(x, weights))
        return tf.reduce_sum(x)

    chunk(tf.constant(1)).numpy()  # trace
    return lambda count: chunk(tf.constant(count)).numpy()


def calibrate() -> None:
    """Print the TF call's fixed cost and matmuls per ms, one process on one core."""
    chunk = _tf_chunk()
    times = {}
    for count in MATMULS_PER_CALL_PROBE:
        samples = []
        for _ in range(21):
            start = time.perf_counter()
            chunk(count)
            samples.append(time.perf_counter() - start)
        times[count] = statistics.median(samples) * 1e3
    low, high = MATMULS_PER_CALL_PROBE
    per_matmul = (times[high] - times[low]) / (high - low)
    print(json.dumps({"call_ms": times[low] - low * per_matmul, "matmul_ms": per_matmul}))


def worker(work_kind: str, pin: str, forward_ms: float, matmul_ms: float) -> None:
    """One rank of the synthetic pipeline; rank 0 prints its median step (ms) as JSON."""
    import numpy as np
    from mpi4py import MPI

    from hyparflow.engine.schedule import make_schedule
    from hyparflow.launch.affinity import pin_if_oversubscribed

    comm = MPI.COMM_WORLD
    rank, stages = comm.Get_rank(), comm.Get_size()
    if work_kind == "tf":
        chunk = _tf_chunk()

        def work(ms):
            chunk(max(1, round(ms / matmul_ms)))
    else:

        def work(ms):
            start, x = time.thread_time(), 0
            while time.thread_time() - start < ms * 1e-3:
                for i in range(100):
                    x += i

    if pin == "pinned":
        pin_if_oversubscribed(comm)
    actions = make_schedule("1f1b", stages, MICROBATCHES)[rank]
    outgoing, incoming = np.zeros(4096, np.float32), np.zeros(4096, np.float32)
    periods = []
    for _ in range(STEPS):
        start, sends = time.perf_counter(), []
        for action in actions:
            source = rank - 1 if action.is_forward else rank + 1
            if 0 <= source < stages:
                comm.Recv(incoming, source=source)
            work(forward_ms if action.is_forward else 2 * forward_ms)
            target = rank + 1 if action.is_forward else rank - 1
            if 0 <= target < stages:
                sends.append(comm.Isend(outgoing, dest=target))
        MPI.Request.Waitall(sends)
        comm.Barrier()
        periods.append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps({"step_ms": statistics.median(periods[3:]) * 1e3}))


def _run(command: list[str]) -> dict:
    env = {**os.environ, **MPI_ENV, **thread_env(1)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def predict_ms(stages: int, forward_ms: float, pinned: bool) -> float:
    from hyparflow.engine.schedule import make_schedule
    from hyparflow.simulate.sharing import shared_pipeline

    cores = os.cpu_count() or 1
    schedule = make_schedule("1f1b", stages, MICROBATCHES)
    run = shared_pipeline(schedule, [forward_ms] * stages, [2 * forward_ms] * stages, 0.0,
                          [[0]] * stages, cores, 0.0, pinned=pinned)  # fmt: skip
    return max(run.finish)


def main(argv=None) -> None:
    args = _arguments(argv)
    if args.worker:
        work_kind, pin, forward_ms, matmul_ms = args.worker
        return worker(work_kind, pin, float(forward_ms), float(matmul_ms))
    if args.calibrate:
        return calibrate()
    here = [sys.executable, __file__]
    tf_cost = _run(["taskset", "-c", "0", *here, "--calibrate"])
    print(f"TF call: {tf_cost['call_ms']:.3f} ms + {tf_cost['matmul_ms']:.3f} ms per matmul, "
          f"{os.cpu_count()} cores, {args.ranks} ranks")  # fmt: skip
    print(" work    size  placement  measured ms  predicted ms  error")
    for size in (float(s) for s in args.sizes.split(",")):
        for work_kind in ("python", "tf"):
            # a TF action costs its matmuls plus the call itself
            action = size + (tf_cost["call_ms"] if work_kind == "tf" else 0.0)
            for pin in ("unpinned", "pinned"):
                command = ["mpirun", "-np", str(args.ranks), "--bind-to", "none", *here,
                           "--worker", work_kind, pin, str(size),
                           str(tf_cost["matmul_ms"])]  # fmt: skip
                measured = _run(command)["step_ms"]
                predicted = predict_ms(args.ranks, action, pin == "pinned")
                error = predicted / measured - 1
                print(f" {work_kind:<6} {size:>5.2f}  {pin:<9} {measured:>11.1f} "
                      f"{predicted:>13.1f} {error:>+6.0%}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
