"""A pipeline schedule run by ranks that share their node's cores (processor sharing).

When a node holds more ranks than cores, the operating system time-slices them: at any moment
the ranks computing on a node split its cores evenly (processor sharing, the standard model of
a time-sharing scheduler; Kleinrock, "Time-Shared Systems: A Theoretical Analysis of
Commonly-Used Scheduling Disciplines", J. ACM 14(2), 1967). A rank that waits for a message
does not compute, but it is not asleep either: Open MPI polls, yielding the processor between
polls when it sees the node oversubscribed (`mpi_yield_when_idle`), so each waiting rank still
holds `idle_share` of a computing one's claim (0: yields at once, 1: spins like a computing
rank). In a deep pipeline many ranks wait at any time (the bubble), so the computing ones run
faster than a uniform `ranks / cores` stretch says.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyparflow.engine.schedule import DeadlockError, Schedule, Simulation, ready_time

_EPSILON = 1e-12


def simulate_shared(
    schedule: Schedule,
    forward_work: Sequence[float],
    backward_work: Sequence[float],
    comm_time: float,
    stage_nodes: Sequence[dict[int, int]],
    cores: int,
    idle_share: float = 0.0,
    background: float = 0.0,
) -> Simulation:
    """Run `schedule` where stage `s` has `stage_nodes[s][n]` ranks on node `n` (its replicas,
    in lock-step) and each node has `cores` cores, `background` of them kept busy by others.

    `forward_work` and `backward_work` are each stage's processor seconds per micro-batch
    with a core to itself. A computing rank on a node under load L (computing ranks, plus
    `idle_share` per waiting rank, plus `background`) progresses at `min(1, cores / L)`; a
    stage with replicas on several nodes at its slowest node's rate. Messages take
    `comm_time` after the sending action ends, as in `engine.schedule.simulate`, which this
    equals when no node is short of cores. Action times are wall-clock; `busy` is the time
    each stage spent computing.

    Example:
        >>> from hyparflow.engine.schedule import one_f_one_b
        >>> sim = simulate_shared(one_f_one_b(4, 4), [1.0] * 4, [2.0] * 4, 0.0,
        ...                       [{0: 1}] * 4, cores=2)
        >>> sim.makespan < 2 * 21.0  # shorter than every rank stretched 4 / 2 = 2x
        True
    """
    stages = len(schedule)
    if not (len(forward_work) == len(backward_work) == len(stage_nodes) == stages):
        raise ValueError("forward_work, backward_work and stage_nodes need one entry per stage")
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    nodes = sorted({n for ranks in stage_nodes for n in ranks})
    times: dict = {}
    next_index = [0] * stages
    remaining: list[float | None] = [None] * stages  # work left in the running action
    started = [0.0] * stages
    busy = [0.0] * stages
    now = 0.0
    while True:
        # start every action whose inputs have arrived
        upcoming = []
        for s in range(stages):
            if remaining[s] is not None or next_index[s] == len(schedule[s]):
                continue
            action = schedule[s][next_index[s]]
            ready = ready_time(times, s, action, stages, comm_time)
            if ready is None:
                continue
            if ready <= now + _EPSILON:
                work = (forward_work if action.is_forward else backward_work)[s]
                remaining[s], started[s] = float(work), now
            else:
                upcoming.append(ready)
        running = [s for s in range(stages) if remaining[s] is not None]
        if not running:
            if upcoming:
                now = min(upcoming)
                continue
            break
        rate = _rates(running, stage_nodes, nodes, cores, idle_share, background)
        finish = min(now + remaining[s] / rate[s] for s in running)
        until = min([finish, *upcoming])
        for s in running:
            remaining[s] -= rate[s] * (until - now)
            busy[s] += until - now
        now = until
        for s in running:
            if remaining[s] <= _EPSILON * max(1.0, now):
                times[s, schedule[s][next_index[s]]] = (started[s], now)
                next_index[s] += 1
                remaining[s] = None
    blocked = [
        f"stage {s} waits at {actions[next_index[s]]}"
        for s, actions in enumerate(schedule)
        if next_index[s] < len(actions)
    ]
    if blocked:
        raise DeadlockError("schedule deadlocks: " + "; ".join(blocked))
    return Simulation(times=times, makespan=now, busy=busy)


def _rates(running, stage_nodes, nodes, cores, idle_share, background) -> dict[int, float]:
    """Each running stage's progress per second: its slowest node's share of a core."""
    load = dict.fromkeys(nodes, background)
    active = set(running)
    for s, ranks in enumerate(stage_nodes):
        weight = 1.0 if s in active else idle_share
        for node, count in ranks.items():
            load[node] += weight * count
    share = {n: min(1.0, cores / load[n]) if load[n] > 0 else 1.0 for n in nodes}
    return {s: min(share[n] for n in stage_nodes[s]) for s in running}
