"""Pin each rank to one core when a node runs more ranks than it has cores (and none is bound).

Used only when the user opts in (`hf.Strategy(tune_process=True)`, `hyparflow.process_tuning`);
binding is otherwise the launcher's job (`mpirun --bind-to core`, `srun --cpu-bind=cores`).

A rank of hyparflow is two busy threads taking turns: the Python thread that drives the
schedule and waits in MPI (Open MPI polls, yielding the core between polls when the node is
oversubscribed), and TensorFlow's compute thread that runs each compiled call while the Python
thread sleeps. Unbound, Linux places these threads independently, and because a polling thread
is always runnable the load balancer sees every core equally busy: two ranks' polling threads
can hold one core while two computing threads share the other.

So when the ranks on a node outnumber the cores they may all use and the launcher bound none
of them, the ranks are dealt to those cores in node-local rank order, every thread of the
process included: each rank to the core with the fewest ranks so far, and among those to one
holding the fewest ranks of its own pipeline stage (`deal_to_cores`). With one stage (data
parallel) or one replica (a pipeline) that is local rank i on the i-th core modulo their
count, so neighbouring stages land on different cores. With both, the stages are mixed on
every core: ranks that share a core then compute at different times of the schedule (one
replica's first stage fills while another's last stage drains), where a core holding only
first stages would idle through the pipeline's fill. Jobs with a core per rank, jobs the
launcher bound, and `HYPARFLOW_PIN_RANKS=0` are left alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

ENVIRONMENT_SWITCH = "HYPARFLOW_PIN_RANKS"


def deal_to_cores(stages: Sequence[int], cores: int) -> list[int]:
    """Which of `cores` cores (0, 1, ...) each rank goes to, ranks in node-local order with
    `stages[i]` the pipeline stage of local rank i: the core with the fewest ranks so far,
    then the one with the fewest of that stage, then the lowest.

    Example:
        >>> deal_to_cores([0, 0, 0, 0], 2)  # data parallel: round robin
        [0, 1, 0, 1]
        >>> deal_to_cores([0, 1, 2, 3], 2)  # a 4-stage pipeline: neighbours apart
        [0, 1, 0, 1]
        >>> deal_to_cores([0, 1, 0, 1], 2)  # 2 stages x 2 replicas: each core holds both stages
        [0, 1, 1, 0]
    """
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    ranks_on = [0] * cores
    stage_on: list[dict[int, int]] = [{} for _ in range(cores)]
    dealt = []
    for stage in stages:
        core = min(range(cores), key=lambda c: (ranks_on[c], stage_on[c].get(stage, 0), c))
        ranks_on[core] += 1
        stage_on[core][stage] = stage_on[core].get(stage, 0) + 1
        dealt.append(core)
    return dealt


def core_for_rank(
    local_rank: int,
    allowed: Sequence[frozenset[int]],
    stages: Sequence[int] | None = None,
    *,
    environ: dict | None = None,
) -> int | None:
    """The core node-local rank `local_rank` should be pinned to, or None to leave it alone.

    `allowed[i]` is the set of cores node-local rank i may run on (before any pinning),
    `stages[i]` its pipeline stage (all 0 when not given). Pinning applies only when every local
    rank may use the same cores (nobody bound them) and there are more ranks than those cores.

    Example:
        >>> cores = [frozenset({0, 1})] * 4
        >>> [core_for_rank(i, cores) for i in range(4)]
        [0, 1, 0, 1]
        >>> [core_for_rank(i, cores, stages=[0, 1, 0, 1]) for i in range(4)]
        [0, 1, 1, 0]
        >>> core_for_rank(0, [frozenset({0, 1})] * 2) is None  # a core per rank
        True
        >>> core_for_rank(0, [frozenset({0}), frozenset({1}), frozenset({0}), frozenset({1})])
    """
    environ = os.environ if environ is None else environ
    if environ.get(ENVIRONMENT_SWITCH, "1") == "0":
        return None
    if not allowed or not 0 <= local_rank < len(allowed):
        raise ValueError(f"local rank {local_rank} is not one of {len(allowed)} local ranks")
    stages = [0] * len(allowed) if stages is None else stages
    if len(stages) != len(allowed):
        raise ValueError(f"{len(stages)} stages given for {len(allowed)} local ranks")
    shared = allowed[0]
    if any(cores != shared for cores in allowed) or len(allowed) <= len(shared):
        return None
    return sorted(shared)[deal_to_cores(stages, len(shared))[local_rank]]


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


_node_cores: list[frozenset[int]] | None = None  # each local rank's cores before pinning


def pin_if_oversubscribed(comm, stage: int = 0) -> int | None:
    """Collective over `comm`: pin this rank, whose pipeline stage is `stage`, as
    `core_for_rank` says for the ranks sharing its node; returns the core, or None when left
    alone. Each call deals again (a later fit may lay out another grid), from the cores the
    ranks had before the first call pinned them."""
    global _node_cores
    from mpi4py import MPI  # on use: importing mpi4py.MPI initialises MPI (comm/world.py)

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        if _node_cores is None:
            _node_cores = node.allgather(frozenset(os.sched_getaffinity(0)))
        stages = node.allgather(stage)
        local_rank = node.Get_rank()
    finally:
        node.Free()
    core = core_for_rank(local_rank, _node_cores, stages)
    if core is not None:
        pin_process(core)
    return core
