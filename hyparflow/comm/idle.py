"""How a rank polls while it waits on its peers: flat out while every rank has a core, backing
off into short sleeps when ranks share cores.

A rank that spins in a wait keeps a core busy. With a core per rank that costs nothing and
answers fastest, so that stays the default. When more ranks than cores share a node (a laptop,
an oversubscribed test machine) a spinning rank takes CPU time from the peer it waits for; there
the wait polls flat out for `SPIN_SECONDS`, then sleeps between polls, each sleep twice the
last, up to `LONGEST_SLEEP_SECONDS`. This is Open MPI's own rule (`mpi_yield_when_idle`,
on by default when a node is oversubscribed), and its MCA parameter decides here too when set:
`OMPI_MCA_mpi_yield_when_idle=1` backs off, `0` spins.
"""

from __future__ import annotations

import os
import time

YIELD_ENV = "OMPI_MCA_mpi_yield_when_idle"
SPIN_SECONDS = 1e-3  # most waits inside a step end sooner: those keep full-speed polling
FIRST_SLEEP_SECONDS = 5e-5
LONGEST_SLEEP_SECONDS = 2.5e-4  # the most a wait overshoots its peer: ~0.1 ms on average


def shares_cores(comm) -> bool:
    """Collective over `comm`: whether ranks on this rank's node share cores (fewer distinct
    cores among their affinities than ranks), unless `OMPI_MCA_mpi_yield_when_idle` says."""
    from mpi4py import MPI  # on use: importing mpi4py.MPI initialises MPI (comm/world.py)

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        cores = node.allgather(frozenset(os.sched_getaffinity(0)))
    finally:
        node.Free()
    # gathered even where the setting decides: every rank makes the same collective calls
    setting = os.environ.get(YIELD_ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return len(frozenset().union(*cores)) < len(cores)


class Idle:
    """One wait's pauses between polls: call it after each poll that found nothing.

    For example:
        idle = Idle(shares_cores(comm))
        while not request.Test():
            idle()
    """

    def __init__(self, sharing: bool):
        self.sharing = sharing
        self._start = time.monotonic()  # made as its wait begins
        self._sleep = FIRST_SLEEP_SECONDS

    def __call__(self) -> None:
        if not self.sharing:
            os.sched_yield()  # a peer that was given this core anyway runs first
            return
        if time.monotonic() - self._start < SPIN_SECONDS:
            os.sched_yield()
            return
        time.sleep(self._sleep)
        self._sleep = min(2 * self._sleep, LONGEST_SLEEP_SECONDS)
