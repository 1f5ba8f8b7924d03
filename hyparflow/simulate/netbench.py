"""Measure this machine's `Network`: mpi4py ping-pong and allreduce, and hyparflow's own costs.

Run under MPI with two ranks (`launch()` does it: `mpirun -np 2 python -m
hyparflow.simulate.netbench OUT.json`); rank 0 writes the JSON that `Network.from_dict` reads.

- latency and bandwidth: ping-pong of numpy buffers from 8 B to 16 MiB; the one-way time of
  the smallest message is the latency, a line through the large ones gives the bandwidth.
- reduce rate: in-place `Allreduce` from 64 KiB to 16 MiB, less what the links explain.
- per-message overhead: the same ping-pong through hyparflow's `PipeChannel` (TF tensors,
  tags, zero-copy wrapping), less the raw one, per send or receive.
- copy rate: hyparflow's `GradientReducer` on a list of gradients, less one raw allreduce of
  the same bytes.

The two ranks share a node, so this measures the intra-node link only; give the inter-node
one from the network's specification (or run this with one rank on each of two nodes and use
its intra figures as the inter link).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

PINGPONG_SIZES = [8, 1024, 16 * 1024, 256 * 1024, 1 << 20, 4 << 20, 16 << 20]
ALLREDUCE_SIZES = [64 * 1024, 1 << 20, 4 << 20, 16 << 20]
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
}


def launch(out_path: str, python: str = sys.executable, timeout: float = 600) -> dict:
    """Run this benchmark on two local ranks with `mpirun`; returns the network dict."""
    command = ["mpirun", "-np", "2", "--bind-to", "none", python, "-m", __name__, out_path]
    result = subprocess.run(
        command, env={**os.environ, **MPI_ENV}, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0 or not os.path.exists(out_path):
        raise RuntimeError(
            f"network benchmark failed ({' '.join(command)}):\n{result.stderr[-3000:]}"
        )
    with open(out_path) as f:
        return json.load(f)


def one_way(comm, nbytes: int, repeats: int) -> float:
    """Median one-way time of a raw mpi4py ping-pong of `nbytes` between ranks 0 and 1."""
    buffer = np.zeros(max(1, nbytes), dtype=np.uint8)
    peer = 1 - comm.Get_rank()
    samples = []
    for i in range(repeats + 2):
        comm.Barrier()
        start = time.perf_counter()
        if comm.Get_rank() == 0:
            comm.Send(buffer, dest=peer, tag=7)
            comm.Recv(buffer, source=peer, tag=7)
        else:
            comm.Recv(buffer, source=peer, tag=7)
            comm.Send(buffer, dest=peer, tag=7)
        if i >= 2:  # the first rounds set up the connection and buffers
            samples.append((time.perf_counter() - start) / 2)
    return statistics.median(samples)


def allreduce_time(comm, nbytes: int, repeats: int) -> float:
    """Median time of one in-place float32 `Allreduce` of `nbytes` (slowest rank's)."""
    from mpi4py import MPI

    buffer = np.ones(nbytes // 4, dtype=np.float32)
    samples = []
    for i in range(repeats + 2):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buffer)
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= 2:
            samples.append(elapsed)
    return statistics.median(samples)


def channel_one_way(comm, nbytes: int, repeats: int) -> float:
    """Median one-way time of the same ping-pong through hyparflow's `PipeChannel`."""
    import tensorflow as tf

    from hyparflow.comm.p2p import BACKWARD, FORWARD, PipeChannel

    rows = max(1, nbytes // 4 // 16)
    spec = [((rows, 16), "float32")]
    channel = PipeChannel(comm, 1 - comm.Get_rank(), spec, num_microbatches=1)
    tensor = tf.ones((rows, 16), tf.float32)
    samples = []
    for i in range(repeats + 2):
        comm.Barrier()
        start = time.perf_counter()
        if comm.Get_rank() == 0:
            channel.isend([tensor], 0, FORWARD)
            channel.recv(0, BACKWARD)
        else:
            (received,) = channel.recv(0, FORWARD)
            channel.isend([received], 0, BACKWARD)
        channel.wait_sends()
        if i >= 2:
            samples.append((time.perf_counter() - start) / 2)
    channel.close()
    return statistics.median(samples)


def reducer_time(comm, nbytes: int, repeats: int, pieces: int = 16) -> float:
    """Median time of hyparflow's `GradientReducer` summing `pieces` gradients of `nbytes`."""
    import tensorflow as tf
    from mpi4py import MPI

    from hyparflow.comm.allreduce import GradientReducer

    grads = [tf.ones((nbytes // 4 // pieces,), tf.float32) for _ in range(pieces)]
    reducer = GradientReducer(comm, specs=grads, op="sum")
    samples = []
    for i in range(repeats + 2):
        comm.Barrier()
        start = time.perf_counter()
        result = reducer.reduce(grads)
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        del result
        if i >= 2:
            samples.append(elapsed)
    return statistics.median(samples)


def fit_network(pingpong: dict, allreduce: dict, channel: dict, reducer: dict, ranks: int) -> dict:
    """Turn the timings (seconds by size in bytes) into `Network.from_dict` fields."""
    sizes = sorted(pingpong)
    latency = pingpong[sizes[0]]
    large = [n for n in sizes if n >= 1 << 20]
    slope = np.polyfit(large, [pingpong[n] for n in large], 1)[0]
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    share = (ranks - 1) / ranks
    # what the links do in the bandwidth-optimal algorithms; the rest is the arithmetic
    wire = {n: 2 * share * n / bandwidth + 2 * np.log2(ranks) * latency for n in allreduce}
    arithmetic = [(share * n, allreduce[n] - wire[n]) for n in sorted(allreduce)]
    per_byte = np.polyfit([a for a, _ in arithmetic], [t for _, t in arithmetic], 1)[0]
    reduce_rate = 1.0 / per_byte if per_byte > 0 else None
    overheads = [(channel[n] - pingpong[n]) / 2 for n in channel]
    copies = [(reducer[n] - allreduce[n]) / n for n in reducer]
    copy_per_byte = statistics.median(copies)
    return {
        "intra": {"latency": latency, "bandwidth": bandwidth},
        "inter": None,
        "reduce_rate": reduce_rate,
        "overhead": max(0.0, statistics.median(overheads)),
        "copy_rate": 1.0 / copy_per_byte if copy_per_byte > 0 else None,
        "source": {
            "measured": "hyparflow.simulate.netbench",
            "ranks": ranks,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "pingpong_one_way_s": {str(n): t for n, t in pingpong.items()},
            "allreduce_s": {str(n): t for n, t in allreduce.items()},
            "channel_one_way_s": {str(n): t for n, t in channel.items()},
            "reducer_s": {str(n): t for n, t in reducer.items()},
        },
    }


def run(comm, repeats: int = 30) -> dict | None:
    """Every measurement on ranks 0 and 1 of `comm`; rank 0 returns the fitted network."""
    pingpong = {n: one_way(comm, n, repeats) for n in PINGPONG_SIZES}
    allreduce = {n: allreduce_time(comm, n, repeats) for n in ALLREDUCE_SIZES}
    channel = {n: channel_one_way(comm, n, repeats) for n in (1024, 1 << 20)}
    reducer = {n: reducer_time(comm, n, repeats) for n in (1 << 20, 16 << 20)}
    if comm.Get_rank() != 0:
        return None
    return fit_network(pingpong, allreduce, channel, reducer, comm.Get_size())


def main(argv=None) -> int:
    from mpi4py import MPI

    argv = sys.argv[1:] if argv is None else argv
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        print("netbench needs exactly 2 ranks: mpirun -np 2 python -m", __name__, file=sys.stderr)
        return 2
    network = run(comm)
    if network is not None:
        with open(argv[0], "w") as f:
            json.dump(network, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
