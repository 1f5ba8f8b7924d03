"""Time one step's gradient reduction: HorovodReducer against hyparflow's GradientReducer.

Run (Horovod is in the compatibility venv that `make test-compat` builds):
    mpirun -np 2 .venv-compat/bin/python benchmarks/horovod_reduce.py [--model resnet50]

Gradients are random tensors shaped like the model's trainable variables; every rank reduces
them over all ranks with each backend, `--repeats` times, and rank 0 prints the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from hyparflow.comm.backends import make_reducer  # noqa: E402
from hyparflow.comm.topology import Topology  # noqa: E402
from hyparflow.comm.world import world  # noqa: E402

MODELS = {
    "mlp": lambda: keras.Sequential(
        [keras.Input((784,)), keras.layers.Dense(512), keras.layers.Dense(10)]
    ),
    "resnet50": lambda: keras.applications.ResNet50(weights=None),
}


def median_ms(reducer, grads, repeats: int, comm) -> tuple[float, list]:
    result = reducer.reduce(grads)  # warm up: buckets, process sets, Horovod's fusion buffer
    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        result = [tf.convert_to_tensor(g) for g in reducer.reduce(grads)]
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--repeats", type=int, default=20)
    options = parser.parse_args()
    comm = world()
    topology = Topology.create(comm, partitions=1, replicas=comm.Get_size())
    variables = MODELS[options.model]().trainable_variables
    rng = np.random.default_rng(comm.Get_rank())
    grads = [tf.constant(rng.normal(size=v.shape).astype("float32")) for v in variables]
    megabytes = sum(g.numpy().nbytes for g in grads) / 2**20
    timings = {}
    for backend in ("mpi", "horovod"):
        reducer = make_reducer(backend, topology, variables)
        timings[backend], reduced = median_ms(reducer, grads, options.repeats, comm)
        expected = comm.allreduce(grads[0].numpy())
        np.testing.assert_allclose(reduced[0].numpy(), expected, rtol=1e-5, atol=1e-5)
    if comm.Get_rank() == 0:
        print(
            f"{options.model}: {len(grads)} gradients, {megabytes:.1f} MiB, {comm.Get_size()} "
            f"ranks; median of {options.repeats}: "
            + ", ".join(f"{name} {ms:.2f} ms" for name, ms in timings.items())
        )


if __name__ == "__main__":
    main()
