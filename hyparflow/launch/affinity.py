"""Pin each rank to one core when a node runs more ranks than it has cores (and none is bound).

A rank of hyparflow is two busy threads taking turns: the Python thread that drives the
schedule and waits in MPI (Open MPI polls, yielding the core between polls when the node is
oversubscribed), and TensorFlow's compute thread that runs each compiled call while the Python
thread sleeps. Unbound, Linux places these threads independently, and because a polling thread
is always runnable the load balancer sees every core equally busy: two ranks' polling threads
can hold one core while two computing threads share the other. Measured on the 2-core
development VM with 4 ranks (benchmarks/analysis.md, 2026-11-25): a synthetic 4-stage
pipeline of TensorFlow calls ran 5-10% slower unbound than with each rank's threads on one
core, and the validation MLP's 4-way data-parallel step 29.4 ms unbound against 22.7 ms pinned.

So when the ranks on a node outnumber the cores they may all use and the launcher bound none
of them (`mpirun --bind-to none`, or Open MPI's default once it oversubscribes), hyparflow deals
them to those cores in node-local rank order, local rank i to the i-th core modulo their count,
every thread of the process included. Neighbouring pipeline stages land on different cores.
`hyparflow simulate` assumes the same placement. Jobs with a core per rank, jobs the launcher
bound (`--bind-to core`, `srun --cpu-bind`), and `HYPARFLOW_PIN_RANKS=0` are left alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

ENVIRONMENT_SWITCH = "HYPARFLOW_PIN_RANKS"


def core_for_rank(
    local_rank: int, allowed: Sequence[frozenset[int]], environ: dict | None = None
) -> int | None:
    """The core node-local rank `local_rank` should be pinned to, or None to leave it alone.

    `allowed[i]` is the set of cores node-local rank i may run on now. Pinning applies only
    when every local rank may use the same cores (nobody bound them) and there are more ranks
    than those cores.

    Example:
        >>> cores = [frozenset({0, 1})] * 4
        >>> [core_for_rank(i, cores) for i in range(4)]
        [0, 1, 0, 1]
        >>> core_for_rank(0, [frozenset({0, 1})] * 2) is None  # a core per rank
        True
        >>> core_for_rank(0, [frozenset({0}), frozenset({1}), frozenset({0}), frozenset({1})])
    """
    environ = os.environ if environ is None else environ
    if environ.get(ENVIRONMENT_SWITCH, "1") == "0":
        return None
    if not allowed or not 0 <= local_rank < len(allowed):
        raise ValueError(f"local rank {local_rank} is not one of {len(allowed)} local ranks")
    shared = allowed[0]
    if any(cores != shared for cores in allowed) or len(allowed) <= len(shared):
        return None
    return sorted(shared)[local_rank % len(shared)]


def pin_process(core: int) -> int:
    """Restrict every thread of this process (and threads it starts later) to `core`;
    returns how many threads were pinned. Threads that end meanwhile are skipped."""
    pinned = 0
    for name in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(name), {core})
        except (ProcessLookupError, PermissionError):
            continue
        pinned += 1
    return pinned


_decided: int | None | bool = False  # False: not decided yet in this process


def pin_if_oversubscribed(comm) -> int | None:
    """Collective over `comm`, once per process: pin this rank as `core_for_rank` says for
    the ranks sharing its node; returns the core, or None when left alone."""
    global _decided
    if _decided is not False:
        return _decided
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        allowed = node.allgather(frozenset(os.sched_getaffinity(0)))
        core = core_for_rank(node.Get_rank(), allowed)
    finally:
        node.Free()
    if core is not None:
        pin_process(core)
    _decided = core
    return core
