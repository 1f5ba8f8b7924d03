"""Figure 2, point-to-point: PipeChannel ping-pong bandwidth vs raw mpi4py, 64 KiB to 64 MiB.

Run: .venv/bin/python benchmarks/p2p_bandwidth.py [--repeats 7] [--out FILE]
     (starts `mpirun -np 2` itself)

Two ranks bounce one message back and forth, as a pipeline moves an activation forward and
its gradient back; bandwidth = 2 x bytes per round trip / time. Ways, alternating in blocks:

- raw mpi4py (the reference): blocking `Send`/`Recv` of numpy buffers, rank 0 sending from one
  buffer and receiving into another (a pipeline keeps its activation while the gradient comes);
- raw, one buffer both ways (shown, not the reference: it stays in the cache);
- PipeChannel: rank 0 `isend`s a TF tensor and `recv`s the reply; rank 1 sends back the
  zero-copy view of its receive buffer.

Target: paired PipeChannel / raw at 4 MiB and above. `--hugetlb` repeats everything with
glibc's malloc backing large blocks with transparent huge pages.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement, target  # noqa: E402
from benchmarks.harness.stats import paired_ratios  # noqa: E402

FIGURE = "p2p"
TITLE = "(2) Point-to-point: PipeChannel vs raw mpi4py ping-pong"
KIB = 1024
SIZES = [64 * KIB, 256 * KIB, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20]
ROW = 256  # float32 values per row of the boundary tensor (its "batch" is the row count)
WAYS = {
    "raw": "raw mpi4py Send/Recv",
    "raw_one_buffer": "raw, one buffer both ways",
    "channel": "PipeChannel",
}
# glibc's malloc can back its large blocks with transparent huge pages (THP "madvise" mode);
# TensorFlow's CPU tensors come from malloc, so this changes how fast MPI copies them.
ENVIRONMENTS = {"default": {}, "glibc hugetlb": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}}


def round_trips(size: int) -> int:
    """Enough round trips that a block moves about 512 MiB (at least 10, at most 2000)."""
    return max(10, min(2000, 512 * 2**20 // size))


def raw_block(comm, send_buffer, receive_buffer, n: int) -> float:
    """Seconds for `n` blocking Send/Recv round trips: rank 0 sends `send_buffer` and receives
    into `receive_buffer`; rank 1 receives into its `receive_buffer` and sends that back."""
    from mpi4py import MPI

    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    out, into = [send_buffer, MPI.BYTE], [receive_buffer, MPI.BYTE]
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            comm.Send(out, dest=peer, tag=7)
            comm.Recv(into, source=peer, tag=7)
        else:
            comm.Recv(into, source=peer, tag=7)
            comm.Send(into, dest=peer, tag=7)
    return time.perf_counter() - start


def channel_block(comm, channel, tensor, n: int) -> float:
    """Seconds for `n` PipeChannel round trips: `tensor` forward, the received view back."""
    from hyparflow.comm.p2p import BACKWARD, FORWARD

    comm.Barrier()
    start = time.perf_counter()
    for _ in range(n):
        if comm.Get_rank() == 0:
            handle = channel.isend([tensor], 0, FORWARD)
            (reply,) = channel.recv(0, BACKWARD)
            handle.wait()
        else:
            (reply,) = channel.recv(0, FORWARD)
            channel.isend([reply], 0, BACKWARD).wait()
        del reply  # frees the slot, so the next receive reuses its buffer
    return time.perf_counter() - start


def worker(args) -> None:
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    from hyparflow.comm.p2p import PipeChannel
    from hyparflow.launch.malloc import keep_temporaries_in_heap

    keep_temporaries_in_heap()  # what hf.fit does in every multi-rank process
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    results = {way: {} for way in WAYS}
    results["allocations"] = {}
    for size in args.sizes:
        rows = size // (4 * ROW)
        data = np.random.default_rng(rank).normal(size=(rows, ROW)).astype("float32")
        send_buffer, receive_buffer, tensor = data.copy(), data.copy(), tf.constant(data)
        channel = PipeChannel(comm, 1 - rank, [((rows, ROW), tf.float32)], 1)
        n = round_trips(size)
        ways = {
            "raw": lambda s=send_buffer, r=receive_buffer, n=n: raw_block(comm, s, r, n),
            "raw_one_buffer": lambda r=receive_buffer, n=n: raw_block(comm, r, r, n),
            "channel": lambda c=channel, t=tensor, n=n: channel_block(comm, c, t, n),
        }
        for block in ways.values():  # warm-up: connections, buffers
            block()
        times = {way: [] for way in ways}
        for repeat in range(args.repeats):
            order = list(ways) if repeat % 2 == 0 else list(ways)[::-1]
            for way in order:
                times[way].append(ways[way]())
        for way, seconds in times.items():
            results[way][size] = [2 * size * n / t / 1e9 for t in seconds]
        results["allocations"][size] = channel.allocations
        channel.close()
    if rank == 0:
        write_result(args.worker_out, 0, results)


def run(args) -> list[dict]:
    sizes = args.sizes[:3] if args.quick else args.sizes
    worker_args = ["--repeats", args.repeats, "--sizes", *sizes]
    records = []
    for environment, env in ENVIRONMENTS.items():
        if environment != "default" and not args.hugetlb:
            continue
        result = run_worker(__file__, worker_args, np=2, env=env)[0]
        suffix = "" if environment == "default" else f" [{environment}]"
        for way, label in WAYS.items():
            for size in sizes:
                name = f"{label}{suffix}, {_label(size)}"
                values = result[way][str(size)]
                records.append(
                    measurement(
                        FIGURE,
                        name,
                        values,
                        "GB/s",
                        series=label + suffix,
                        x=size / 2**20,
                        x_label="message size (MiB)",
                        round_trips=round_trips(size),
                    )
                )
        for size in sizes:
            if size >= 4 * 2**20:
                ratios = paired_ratios(result["channel"][str(size)], result["raw"][str(size)])
                name = f"PipeChannel / raw bandwidth{suffix}, {_label(size)}"
                sets = result["allocations"][str(size)]
                records.append(target(FIGURE, name, ratios, ">= 0.9", buffer_sets=sets))
    return records


def _label(size: int) -> str:
    return f"{size // 2**20} MiB" if size >= 2**20 else f"{size // KIB} KiB"


def arguments(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message bytes")
    p.add_argument("--hugetlb", action="store_true", help="also run with glibc.malloc.hugetlb=1")
    return p.parse_args(argv)


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
