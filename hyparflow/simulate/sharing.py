"""A pipeline schedule run by ranks that share their node's cores (processor sharing).

When a node holds more ranks than cores, the operating system time-slices them: the ranks
computing on one core split it evenly (processor sharing, the standard model of a
time-sharing scheduler; Kleinrock, "Time-Shared Systems: A Theoretical Analysis of
Commonly-Used Scheduling Disciplines", J. ACM 14(2), 1967). A rank that waits for a message
does not compute, but it is not asleep either: Open MPI polls, yielding the processor between
polls when it sees the node oversubscribed (`mpi_yield_when_idle`), so each waiting rank still
holds `idle_share` of a computing one's claim (0: yields at once, 1: spins like a computing
rank). hyparflow pins the ranks of such a node to its cores in node-local rank order, mixing
the stages on each core (`hyparflow.launch.affinity.deal_to_cores`), so a computing rank shares
its core with the ranks dealt to it, busy or not, even while another core only has waiting
ranks; `shared_pipeline` runs that placement. Unpinned (`HYPARFLOW_PIN_RANKS=0`), Linux
balances run queues by how many tasks they hold, a polling rank counts as one, and which ranks
share a core is chance: the schedule is then averaged over the even placements. In a deep
pipeline many ranks wait at any time (the bubble), so the computing ones run faster than a
uniform `ranks / cores` stretch says, but slower than if every idle core could take them.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from hyparflow.engine.schedule import Schedule, Simulation, raise_if_blocked, ready_time
from hyparflow.launch.affinity import deal_to_cores

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
    setup_work: Sequence[float] | None = None,
    timeslice: float = 1.0,
    wakeup: float = 0.0,
) -> Simulation:
    """Run `schedule` where stage `s` has `stage_nodes[s][n]` ranks on node `n` (its replicas,
    in lock-step) and each node has `cores` cores, `background` of them kept busy by others.

    `forward_work` and `backward_work` are each stage's processor seconds per micro-batch
    with a core to itself; `setup_work`, each stage's processor seconds before its first
    action (the training loop's bookkeeping between steps), shares the cores like them. A
    computing rank on a node under load L (computing ranks, plus `idle_share` per waiting
    rank, plus `background`) progresses at `min(1, cores / L)`; a stage with replicas on
    several nodes at its slowest node's rate. While more ranks compute on a node than it has
    cores, the operating system switches between them every few milliseconds and each switch
    costs the incoming rank its caches: their work then takes `timeslice` times the
    processor time it takes alone. Messages take `comm_time` after the sending action ends,
    as in `engine.schedule.simulate`, which this equals when no node is short of cores.
    A message that finds its receiver waiting while another rank computes on the receiver's
    core is picked up only when the scheduler takes the core from that rank: at its next
    tick or at the end of its action, whichever comes first (`wakeup`: the mean wait when
    that rank computes on; `wake_wait`). The wait is lost to both: the woken rank keeps its
    share of the core meanwhile, because Linux's EEVDF scheduler repays a runnable rank the
    time it did not get (its lag) once it runs, at its core-mate's expense. Action times are
    wall-clock; `busy` is the time each stage spent computing.

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
    # work left in the running action; the setup runs first, as an action of its own
    setup = [float(w) for w in setup_work] if setup_work is not None else [0.0] * stages
    in_setup = [w > 0 for w in setup]
    remaining: list[float | None] = [w if w > 0 else None for w in setup]
    started = [0.0] * stages
    waking: list[float | None] = [None] * stages  # when a woken stage gets its core
    busy = [0.0] * stages
    began, last = [0.0] * stages, [0.0] * stages  # each stage's setup end and last action end
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
            if ready > now + _EPSILON:
                upcoming.append(ready)
                continue
            if wakeup > 0 and waking[s] is None and ready > last[s] + _EPSILON:
                # it was waiting when its input arrived (now): does a core-mate hold the core?
                held = _core_mates_work(s, remaining, stage_nodes)
                if held > 0:
                    waking[s] = now + wake_wait(held, wakeup)
            if waking[s] is not None and waking[s] > now + _EPSILON:
                upcoming.append(waking[s])
                continue
            waking[s] = None
            work = (forward_work if action.is_forward else backward_work)[s]
            remaining[s], started[s] = float(work), now
        running = [s for s in range(stages) if remaining[s] is not None]
        if not running:
            if upcoming:
                now = min(upcoming)
                continue
            break
        # a woken stage keeps its claim on its cores while it waits for them (below)
        woken = [s for s in range(stages) if waking[s] is not None]
        rate = _rates(running, stage_nodes, nodes, cores, idle_share, background, timeslice,
                      woken)  # fmt: skip
        finish = min(now + remaining[s] / rate[s] for s in running)
        until = min([finish, *upcoming])
        for s in running:
            remaining[s] -= rate[s] * (until - now)
            if not in_setup[s]:
                busy[s] += until - now
        now = until
        for s in running:
            if remaining[s] <= _EPSILON * max(1.0, now):
                if in_setup[s]:
                    in_setup[s], began[s], last[s] = False, now, now
                else:
                    times[s, schedule[s][next_index[s]]] = (started[s], now)
                    next_index[s] += 1
                    last[s] = now
                remaining[s] = None
    raise_if_blocked(schedule, next_index)
    span = max((end - start for end, start in zip(last, began)), default=0.0)
    return Simulation(times=times, makespan=now, busy=busy, span=span)


def wake_wait(held: float, wakeup: float) -> float:
    """Expected wait of a rank woken on a core where another rank computes `held` more
    seconds: the scheduler preempts that rank at its next tick, uniform over [0, 2 *
    wakeup] (wakeup: the mean wait measured against a rank that never lets go), unless its
    action ends first: E[min(held, U)].

    Example:
        >>> wake_wait(10.0, 2.0), wake_wait(2.0, 2.0)  # a long action: the mean; short: less
        (2.0, 1.5)
    """
    if held >= 2 * wakeup:
        return wakeup
    return held - held * held / (4 * wakeup)


def _core_mates_work(stage: int, remaining, stage_nodes) -> float:
    """The most processor seconds any other stage computing on `stage`'s cores has left
    in its running action (0 if none computes there)."""
    mine = stage_nodes[stage].keys()
    return max(
        (
            left
            for q, left in enumerate(remaining)
            if q != stage and left is not None and mine & stage_nodes[q].keys()
        ),
        default=0.0,
    )


def _rates(
    running, stage_nodes, nodes, cores, idle_share, background, timeslice=1.0, woken=()
) -> dict[int, float]:
    """Each running stage's progress per second: its slowest node's share of a core, less
    the switching cost (`timeslice`) where computing ranks outnumber the cores. `woken`
    stages count as computing: the scheduler owes them the time they wait (EEVDF's lag)
    and takes it back from their core-mates once they run."""
    load = dict.fromkeys(nodes, background)
    computing = dict.fromkeys(nodes, background)
    active = set(running) | set(woken)
    for s, ranks in enumerate(stage_nodes):
        weight = 1.0 if s in active else idle_share
        for node, count in ranks.items():
            load[node] += weight * count
            computing[node] += count if s in active else 0
    share = {
        n: (min(1.0, cores / load[n]) if load[n] > 0 else 1.0)
        / (timeslice if computing[n] > cores + _EPSILON else 1.0)
        for n in nodes
    }
    return {s: min(share[n] for n in stage_nodes[s]) for s in running}


@dataclass
class SharedPipeline:
    """A schedule's timing averaged over core placements: each stage's finish, its computing
    time (`busy`), the bubble, and how many placements were averaged."""

    finish: list[float]
    busy: list[float]
    bubble: float
    placements: int


def shared_pipeline(
    schedule: Schedule,
    forward_work: Sequence[float],
    backward_work: Sequence[float],
    comm_time: float,
    rank_nodes: Sequence[Sequence[int]],
    cores: int,
    idle_share: float = 0.0,
    background: float = 0.0,
    limit: int = 64,
    pinned: bool = True,
    setup_work: Sequence[float] | None = None,
    timeslice: float = 1.0,
    wakeup: float = 0.0,
) -> SharedPipeline:
    """Run `schedule` with every node's ranks spread evenly over its `cores` cores.
    `pinned`: as hyparflow pins them, the node's ranks in rank order (replica x stages +
    stage) dealt by `deal_to_cores`; else averaged over the even placements (all
    distinct ones when there are at most `limit`, else `limit` drawn at random with a fixed
    seed). `rank_nodes[s][q]` is the node of stage `s`'s replica `q`; `background` cores'
    worth of other work is spread over the cores; `setup_work`, `timeslice` and `wakeup` as
    in `simulate_shared`.

    Example:
        >>> from hyparflow.engine.schedule import one_f_one_b
        >>> run = shared_pipeline(one_f_one_b(4, 4), [1.0] * 4, [2.0] * 4, 0.0,
        ...                       [[0]] * 4, cores=2)
        >>> run.placements, 21.0 < max(run.finish) < 2 * 21.0
        (1, True)
        >>> shared_pipeline(one_f_one_b(4, 4), [1.0] * 4, [2.0] * 4, 0.0, [[0]] * 4,
        ...                 cores=2, pinned=False).placements
        3
    """
    by_node = _ranks_by_node(rank_nodes)
    stages = len(schedule)
    if pinned:
        choices = [[_pinned_placement(members, cores)] for members in by_node.values()]
    else:
        choices = [_even_placements(members, cores, limit) for members in by_node.values()]
    if math.prod(len(c) for c in choices) <= limit:
        combos = list(itertools.product(*choices))
    else:
        rng = random.Random(0)
        combos = [tuple(rng.choice(c) for c in choices) for _ in range(limit)]
    finish, busy, bubble = [0.0] * stages, [0.0] * stages, 0.0
    for combo in combos:
        core_of = {}
        for n, groups in enumerate(combo):
            for c, group in enumerate(groups):
                core_of.update({rank: (n, c) for rank in group})
        stage_cores = []
        for s in range(stages):
            counts: dict = {}
            for q in range(len(rank_nodes[s])):
                counts[core_of[s, q]] = counts.get(core_of[s, q], 0) + 1
            stage_cores.append(counts)
        ids = {core: i for i, core in enumerate(sorted({c for d in stage_cores for c in d}))}
        sim = simulate_shared(
            schedule, forward_work, backward_work, comm_time,
            [{ids[c]: k for c, k in d.items()} for d in stage_cores], 1, idle_share,
            background / cores, setup_work, timeslice, wakeup,
        )  # fmt: skip
        ends = [0.0] * stages
        for (s, _), (_, end) in sim.times.items():
            ends[s] = max(ends[s], end)
        finish = [f + e / len(combos) for f, e in zip(finish, ends)]
        busy = [b + x / len(combos) for b, x in zip(busy, sim.busy)]
        bubble += sim.bubble / len(combos)
    return SharedPipeline(finish=finish, busy=busy, bubble=bubble, placements=len(combos))


def _ranks_by_node(rank_nodes: Sequence[Sequence[int]]) -> dict[int, list[tuple[int, int]]]:
    """Each node's ranks as (stage, replica), from `rank_nodes[s][q]`, the node of stage `s`'s
    replica `q`."""
    by_node: dict[int, list[tuple[int, int]]] = {}
    for s, nodes in enumerate(rank_nodes):
        for q, node in enumerate(nodes):
            by_node.setdefault(node, []).append((s, q))
    return by_node


def replicas_share_a_core(
    rank_nodes: Sequence[Sequence[int]], cores: int, pinned: bool = True
) -> list[bool]:
    """For each stage, whether two of its replicas run on one core: as hyparflow pins a
    node's ranks (stages mixed on each core), or, unpinned, wherever a node holds more of
    them than it has cores (every placement then puts two on one core).

    Example:
        >>> replicas_share_a_core([[0, 0, 0, 0]], cores=2)  # data parallel, 4 ranks, 2 cores
        [True]
        >>> replicas_share_a_core([[0, 0], [0, 0]], cores=2)  # 2 x 2: each core holds both stages
        [False, False]
        >>> replicas_share_a_core([[0, 1], [0, 1]], cores=1)  # 2 x 2 over 2 nodes of 1 core
        [False, False]
    """
    shared = [False] * len(rank_nodes)
    for members in _ranks_by_node(rank_nodes).values():
        groups = [members] if not pinned else _pinned_placement(members, cores)
        most = 1 if pinned else cores
        for group in groups:
            stages = [s for s, _ in group]
            for s in set(stages):
                shared[s] = shared[s] or stages.count(s) > most
    return shared


def _pinned_placement(members: list, cores: int) -> tuple[tuple, ...]:
    """The pinned placement: a node's ranks (stage, replica) in rank order (by replica, then
    stage: the engine's `Grid`) dealt to its cores as `hyparflow.launch.affinity` deals them.

    Example:
        >>> _pinned_placement([(0, 0), (1, 0), (0, 1), (1, 1)], 2)
        (((0, 0), (1, 1)), ((0, 1), (1, 0)))
    """
    ordered = sorted(members, key=lambda rank: (rank[1], rank[0]))
    dealt = deal_to_cores([stage for stage, _ in ordered], cores)
    groups = [
        tuple(sorted(r for r, c in zip(ordered, dealt) if c == core)) for core in range(cores)
    ]
    return tuple(sorted(group for group in groups if group))


def _even_placements(members: list, cores: int, limit: int) -> list[tuple[tuple, ...]]:
    """Ways to deal `members` to `cores` cores as evenly as the kernel balances them (core
    order does not matter): all distinct ones up to `limit`, else `limit` random deals."""
    used = min(cores, len(members))
    sizes = [len(members) // used + (i < len(members) % used) for i in range(used)]

    def deal(order) -> tuple[tuple, ...]:
        groups, start = [], 0
        for size in sizes:
            groups.append(tuple(sorted(order[start : start + size])))
            start += size
        return tuple(sorted(groups))

    if len(members) <= 8:
        distinct = sorted({deal(order) for order in itertools.permutations(members)})
        if len(distinct) <= limit:
            return distinct
    rng = random.Random(0)
    return [deal(rng.sample(members, len(members))) for _ in range(limit)]
