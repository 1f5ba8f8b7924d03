"""Measure this machine's `Network` on two ranks: mpi4py ping-pong and allreduce.

`launch()` runs `mpirun -np 2 python -m hyparflow.simulate.netbench OUT.json`. Latency is the
fastest one-way time of an 8-byte ping-pong, bandwidth a line through 1-16 MiB ones (minima:
what the link can do); the reduce rate is what in-place `Allreduce` of 64 KiB-16 MiB takes
(median) beyond the links. Both ranks share a node: this is the intra-node link; take the
inter-node one from the fabric's specification, or run this with a rank on each of two nodes.
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
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def launch(out_path: str, python: str = sys.executable, timeout: float = 600) -> dict:
    """Run this benchmark on two local ranks with `mpirun`; returns the network dict."""
    command = ["mpirun", "-np", "2", "--bind-to", "none", python, "-m", __name__, out_path]
    env = {**os.environ, **MPI_ENV}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"network benchmark failed ({command}):\n{result.stderr[-3000:]}")
    with open(out_path) as f:
        return json.load(f)


def one_way(comm, nbytes: int, repeats: int) -> float:
    """Fastest one-way time of a raw mpi4py ping-pong of `nbytes` between ranks 0 and 1."""
    buffer, peer = np.zeros(max(1, nbytes), dtype=np.uint8), 1 - comm.Get_rank()

    def pingpong():
        if comm.Get_rank() == 0:
            comm.Send(buffer, dest=peer, tag=7)
        comm.Recv(buffer, source=peer, tag=7)
        if comm.Get_rank() == 1:
            comm.Send(buffer, dest=peer, tag=7)

    return _timed(comm, pingpong, repeats, min) / 2


def _timed(comm, operation, repeats: int, pick=statistics.median) -> float:
    """`pick` (median) of the seconds of `repeats` calls of `operation()` on all ranks (the
    slowest rank's each time), after two that set up connections and buffers."""
    from mpi4py import MPI  # here, not at the top: the CLI imports this module without MPI

    samples = []
    for i in range(repeats + 2):
        comm.Barrier()
        start = time.perf_counter()
        operation()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= 2:
            samples.append(elapsed)
    return pick(samples)


def allreduce_time(comm, nbytes: int, repeats: int) -> float:
    """Median time of one in-place float32 `Allreduce` of `nbytes`."""
    from mpi4py import MPI  # here, not at the top: the CLI imports this module without MPI

    buffer = np.ones(nbytes // 4, dtype=np.float32)
    return _timed(comm, lambda: comm.Allreduce(MPI.IN_PLACE, buffer), repeats)


def fit_network(pingpong: dict, allreduce: dict, ranks: int) -> dict:
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
    return {
        "intra": {"latency": latency, "bandwidth": bandwidth},
        "inter": None,
        "reduce_rate": 1.0 / per_byte if per_byte > 0 else None,
        "source": {
            "measured": "hyparflow.simulate.netbench",
            "ranks": ranks,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "pingpong_one_way_s": {str(n): t for n, t in pingpong.items()},
            "allreduce_s": {str(n): t for n, t in allreduce.items()},
        },
    }


def run(comm, repeats: int = 30) -> dict | None:
    """Every measurement on ranks 0 and 1 of `comm`; rank 0 returns the fitted network, with
    the cores the two ranks got over the run in its source (about 2 when nobody else ran)."""
    started = (time.process_time(), time.perf_counter())
    pingpong = {n: one_way(comm, n, repeats) for n in PINGPONG_SIZES}
    allreduce = {n: allreduce_time(comm, n, 2 * repeats) for n in ALLREDUCE_SIZES}
    share = (time.process_time() - started[0]) / (time.perf_counter() - started[1])
    cores_got = comm.allreduce(share)
    if comm.Get_rank() != 0:
        return None
    network = fit_network(pingpong, allreduce, comm.Get_size())
    network["source"]["cores_got"] = cores_got
    return network


def main(argv=None) -> int:
    from mpi4py import MPI  # here, not at the top: the CLI imports this module without MPI

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
