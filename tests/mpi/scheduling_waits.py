"""Four ranks pinned two to a core: how long a message waits for its receiver's core.

Rank 0 and 1 compute (one per core) while ranks 2 and 3 ping-pong, first with computing
ranks that call MPI (and so yield) every few microseconds, then with ones that compute 50 ms
between MPI calls, as a rank inside a TensorFlow call does (`netbench`'s measurements).
"""

import os

from mpi4py import MPI

from hyparflow.simulate.netbench import oversubscribed_one_way, oversubscribed_wakeup
from tests.mpi.report import report, run_or_abort

CORES = 2


def main() -> None:
    comm = MPI.COMM_WORLD
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {allowed[comm.Get_rank() % CORES % len(allowed)]})
    yielding = oversubscribed_one_way(comm, CORES, repeats=50)
    holding = oversubscribed_wakeup(comm, CORES, repeats=50)
    report({"yielding_one_way_s": yielding, "holding_one_way_s": holding})


if __name__ == "__main__":
    run_or_abort(main)
