"""Each rank's `time.perf_counter()` offset from rank 0's: zero on rank 0's host, by ping-pong
(as NTP does) from other hosts.

`perf_counter` reads the host's monotonic clock (CLOCK_MONOTONIC on Linux), which every process
on a host shares, so ranks on one host need no estimate: an estimate would only add the error
of a round trip, which on a busy host can be milliseconds. Across hosts, each host's lowest
rank measures its offset against rank 0 and shares it with the ranks of its host.

Rank 0 sends a message at `t0` on its clock, the peer answers with its own clock reading
`t_peer`, and the answer arrives at `t1`. If the two legs take equally long, the peer read its
clock at rank 0's `(t0 + t1) / 2`, so `offset = t_peer - (t0 + t1) / 2` and a peer time `t`
reads `t - offset` on rank 0's clock. The error is at most half the round trip's asymmetry, so
the round with the shortest round trip is kept.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

ROUNDS = 8
_TAG = 7301  # on a private duplicate of the communicator, so it meets no other traffic


def offset_from_rounds(rounds: Sequence[tuple[float, float, float]]) -> float:
    """The offset from the round `(t0, t_peer, t1)` with the shortest round trip.

    Example:
        >>> offset_from_rounds([(0.0, 5.3, 1.0), (2.0, 7.1, 2.2)])  # second is tighter
        5.0
    """
    if not rounds:
        raise ValueError("offset_from_rounds needs at least one ping-pong round")
    t0, peer, t1 = min(rounds, key=lambda r: r[2] - r[0])
    return round(peer - (t0 + t1) / 2, 9)  # nanoseconds: finer is noise


class ClockAligner:
    """Offsets of every rank's clock from rank 0's over `comm`, host by host.

    Creating it and `offset()` are collective over `comm`; `free()` releases its communicators.

    For example:
        aligner = ClockAligner(MPI.COMM_WORLD)
        on_rank0_clock = time.perf_counter() - aligner.offset()
    """

    def __init__(self, comm):
        from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

        # Ranks sharing a host (key: lowest rank first, so rank 0 leads its host).
        self.host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        leads = self.host.Get_rank() == 0
        self.leaders = comm.Split(0 if leads else MPI.UNDEFINED, comm.Get_rank())

    def offset(self, rounds: int = ROUNDS, clock=time.perf_counter) -> float:
        """This rank's offset from rank 0's clock in seconds (0.0 on rank 0's host)."""
        from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

        offset = 0.0
        if self.leaders != MPI.COMM_NULL and self.leaders.Get_size() > 1:
            offset = ping_pong_offset(self.leaders, rounds, clock)
        return self.host.bcast(offset, root=0)

    def free(self) -> None:
        from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

        if self.leaders != MPI.COMM_NULL:
            self.leaders.Free()
        self.host.Free()


def ping_pong_offset(comm, rounds: int = ROUNDS, clock=time.perf_counter) -> float:
    """This rank's clock offset from rank 0's in seconds (0.0 on rank 0), measured by
    `rounds` ping-pongs with rank 0; collective on `comm`.

    Subtract it from a local `clock()` reading to get rank 0's time.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    offsets = [0.0] * size
    if rank == 0:
        for peer in range(1, size):
            samples = []
            for _ in range(rounds):
                t0 = clock()
                comm.send(None, dest=peer, tag=_TAG)
                peer_time = comm.recv(source=peer, tag=_TAG)
                samples.append((t0, peer_time, clock()))
            offsets[peer] = offset_from_rounds(samples)
    else:
        for _ in range(rounds):
            comm.recv(source=0, tag=_TAG)
            comm.send(clock(), dest=0, tag=_TAG)
    return comm.scatter(offsets, root=0)
