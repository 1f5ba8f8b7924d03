"""Step time, throughput and efficiency of P partitions x R replicas, from costs and a network.

A training step of hyparflow's engine (docs/engine.md) is, on every rank: the pipeline
schedule over the micro-batches (activations forward, gradients backward between neighbour
stages), then the sum of the stage's gradients across its replicas (fused buckets), then the
optimizer; when callbacks read every batch's logs, the training loop then waits for the
last stage's logs (its metric read-out) and every rank agrees on them. The pipeline part is
the schedule simulator of `engine/schedule.py` run with per-stage forward and backward
times (GPipe, Huang et al. 2019; 1F1B, Narayanan et al., "Memory-Efficient Pipeline-Parallel
DNN Training", ICML 2021); the reduction is the allreduce model of `network.py`; the step is
set by the slowest stage.

Ranks that outnumber a node's cores share them: every CPU-bound part of the step is stretched by
`ranks on the node / cores` (waiting ranks count, since MPI polls while it waits). With compute
jitter, the replicas of a stage meet at their allreduce when the slowest arrives (the expected
maximum of R normal variables, as in stragglers studies, e.g. Dean and Barroso, "The Tail at
Scale", CACM 56(2), 2013).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from hyparflow.engine.schedule import make_schedule, simulate
from hyparflow.simulate.costs import ModelCosts
from hyparflow.simulate.network import Network, allreduce, latency_steps
from hyparflow.simulate.placement import Placement
from hyparflow.simulate.sharing import replicas_share_a_core, shared_pipeline, wake_wait


@dataclass(frozen=True)
class Layout:
    """How the job is laid out: HyPar-Flow's partitions and replicas, the pipeline's
    micro-batches and schedule, and how many ranks share a node (None: one node for all).

    Example:
        >>> Layout(partitions=4, replicas=2, microbatches=8, ranks_per_node=4).nodes
        2
    """

    partitions: int = 1
    replicas: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    ranks_per_node: int | None = None

    @property
    def world(self) -> int:
        return self.partitions * self.replicas

    @property
    def placement(self) -> Placement:
        return Placement(self.partitions, self.replicas, self.ranks_per_node or self.world)

    @property
    def nodes(self) -> int:
        return self.placement.nodes

    @property
    def label(self) -> str:
        return f"{self.partitions}x{self.replicas}"


@dataclass(frozen=True)
class Machine:
    """The nodes' processors: `cores_per_node` (None: never short of cores), the cores other
    jobs keep busy (`background`, e.g. a shared development machine's load), `jitter`, the
    coefficient of variation of a rank's compute per step (operating-system noise,
    interference: the replicas of a stage wait for the slowest at their allreduce),
    `corun`, how much slower a core runs a rank while the node's other cores run ranks too,
    and `pinned`: on a node with more ranks than cores, each rank is pinned to one core,
    dealt in node-local rank order with the stages mixed on each core
    (`hyparflow.launch.affinity.deal_to_cores`), as hyparflow does unless
    `HYPARFLOW_PIN_RANKS=0`; `timeslice`, how much more processor time a rank's work takes
    while its core switches between it and other computing ranks (caches refilled after
    every switch; measured with two copies of the model's step on one core)."""

    cores_per_node: int | None = None
    background: float = 0.0
    jitter: float = 0.0
    corun: float = 1.0
    pinned: bool = True
    timeslice: float = 1.0

    def crowded(self, ranks_on_node: int) -> bool:
        """Whether `ranks_on_node` ranks (with the background load) outnumber the cores."""
        if self.cores_per_node is None:
            return False
        return ranks_on_node + self.background > self.cores_per_node

    def co_running(self, ranks_on_node: int) -> float:
        """`corun` when the node runs several ranks, else 1."""
        return self.corun if ranks_on_node > 1 else 1.0

    def slowdown(self, ranks_on_node: int) -> float:
        """How much longer CPU work takes when `ranks_on_node` ranks share the node: `corun`
        when several run at once (each core computes slower while its neighbours are busy:
        shared caches, memory bandwidth, clocks), times `ranks / cores` when they outnumber
        the cores."""
        neighbours = self.co_running(ranks_on_node)
        if self.cores_per_node is None:
            return neighbours
        return neighbours * max(1.0, (ranks_on_node + self.background) / self.cores_per_node)


@dataclass
class Prediction:
    """One configuration's predicted step and its parts (seconds, slowest stage's)."""

    layout: Layout
    global_batch: int
    step_time: float
    pipeline_time: float
    allreduce_time: float
    optimizer_time: float
    bubble: float
    slowdown: float
    between_steps_time: float = 0.0  # the loop's logs and agreement after the step
    stage_starts: list[int] = field(default_factory=list)
    stage_names: list[str] = field(default_factory=list)
    stage_compute: list[float] = field(default_factory=list)  # forward + backward per step
    single_process: bool = False  # one rank runs plain model.fit

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.global_batch / self.step_time

    @property
    def nodes(self) -> int:
        return self.layout.nodes

    def to_dict(self) -> dict:
        layout = self.layout
        return {
            "partitions": layout.partitions,
            "replicas": layout.replicas,
            "microbatches": layout.microbatches,
            "schedule": layout.schedule,
            "ranks_per_node": layout.ranks_per_node or layout.world,
            "nodes": self.nodes,
            "global_batch": self.global_batch,
            "step_time": self.step_time,
            "throughput": self.throughput,
            "pipeline_time": self.pipeline_time,
            "allreduce_time": self.allreduce_time,
            "optimizer_time": self.optimizer_time,
            "between_steps_time": self.between_steps_time,
            "bubble": self.bubble,
            "slowdown": self.slowdown,
            "stage_names": self.stage_names,
            "stage_compute": self.stage_compute,
            "single_process": self.single_process,
        }


def microbatch_size(global_batch: int, layout: Layout) -> int:
    """Samples per micro-batch; the engine needs the global batch to split evenly."""
    pieces = layout.replicas * layout.microbatches
    if global_batch % pieces:
        valid = max(pieces, global_batch // pieces * pieces)
        raise ValueError(
            f"a global batch of {global_batch} does not split into {layout.replicas} replicas "
            f"x {layout.microbatches} micro-batches; use a multiple of {pieces}, e.g. {valid}"
        )
    return global_batch // pieces


def predict(
    costs: ModelCosts,
    network: Network,
    layout: Layout,
    global_batch: int,
    machine: Machine = Machine(),
    starts: list[int] | None = None,
    batch_logs: bool = False,
) -> Prediction:
    """Predict one training step of `layout` on `global_batch` samples.

    One rank in all runs plain `model.fit` (as `hf.fit` does), timed by
    `costs.single_process` when it was measured. `starts` fixes where stages begin (layer
    indices); by default the layers are balanced by time like `balance="time"`.
    `batch_logs`: a callback reads every batch's logs (a progress bar at verbose=1, the
    `ScalingProfiler`), so the loop shares them and agrees on stopping after each step.

    Example:
        >>> p = predict(costs, Network(intra=Link(1e-6, 10e9)), Layout(2, 2, 4), 256)
        >>> p.step_time, p.throughput, p.bubble
    """
    if layout.world == 1 and costs.single_process is not None:
        return _single_process(costs, global_batch, machine)
    batch = microbatch_size(global_batch, layout)
    p, m = layout.partitions, layout.microbatches
    if p > len(costs.layers):
        raise ValueError(
            f"{costs.name} has {len(costs.layers)} layers: it cannot be cut into {p} stages; "
            "use fewer partitions"
        )
    where = layout.placement
    slow = machine.slowdown(where.busiest_node_ranks)
    # short of cores: the pipeline's ranks share the cores they are placed on by the moment
    # (sharing.py), not by a uniform stretch; its actions then carry only the co-run factor
    crowded = machine.crowded(where.busiest_node_ranks)
    compute_slow = machine.co_running(where.busiest_node_ranks) if crowded else slow
    engine = costs.engine
    starts = list(starts) if starts is not None else costs.split(p, batch)
    bounds = [*starts, len(costs.layers)]
    stages = [costs.stage(a, b, batch) for a, b in zip(bounds[:-1], bounds[1:])]

    forward, backward, transfers = [], [], []
    fused = p == 1 and costs.fused is not None  # the engine's one-call step, flat gradients
    for s, stage in enumerate(stages):
        has_prev, has_next = s > 0, s < p - 1
        f = stage.forward + engine.forward_call + (engine.loss.at(batch) if not has_next else 0)
        b = stage.backward + engine.backward_call
        if fused:
            f, b = costs.fused.at(batch), 0.0
        b += engine.accumulate_per_byte * stage.param_bytes * (m - 1) / m
        # posting the sends: the forward's activations, the backward's input gradients
        f += network.overhead * has_next
        b += network.overhead * has_prev
        forward.append(f * compute_slow)
        backward.append(b * compute_slow)
        if has_next:
            crosses = where.pipeline_link_crosses_nodes(s)
            nbytes = costs.cut_bytes[bounds[s + 1]] * batch
            transfers.append(network.pipeline_transfer(nbytes, crosses, slow, crowded))
    # the schedule simulator takes one link delay; the slowest link is the safe choice
    schedule = make_schedule(layout.schedule, p, m)
    comm = max(transfers, default=0.0)
    # the loop's work between steps, before each rank's first action of the next
    setup = [network.loop_work(s, p) * compute_slow for s in range(p)]
    doubled = [False] * p  # two replicas of the stage on one core
    if crowded:
        rank_nodes = [[where.node_of(r) for r in where.grid.stage_ranks(s)] for s in range(p)]
        doubled = replicas_share_a_core(rank_nodes, machine.cores_per_node, machine.pinned)
        run = shared_pipeline(
            schedule, forward, backward, comm, rank_nodes, machine.cores_per_node,
            network.oversubscribed_idle_share, machine.background, pinned=machine.pinned,
            setup_work=setup, timeslice=machine.timeslice,
            wakeup=network.oversubscribed_wakeup,
        )  # fmt: skip
        finish, busy, bubble = run.finish, run.busy, run.bubble
    else:
        sim = simulate(schedule, forward, backward, comm, setup)
        finish, busy, bubble = [0.0] * p, sim.busy, sim.bubble
        for (s, _), (_, end) in sim.times.items():
            finish[s] = max(finish[s], end)

    flows = where.offnode_reductions_per_node()
    straggle = 1.0 + machine.jitter * expected_maximum(layout.replicas)
    finish = [f * straggle for f in finish]
    ends, parts = [None] * p, [None] * p
    stage_hosts = [{where.node_of(r) for r in where.grid.stage_ranks(s)} for s in range(p)]
    for s in sorted(range(p), key=finish.__getitem__):  # in the order the stages get there
        stage = stages[s]
        crosses = where.stage_nodes(s) > 1
        reduce = network.gradient_allreduce(
            stage.param_bytes, layout.replicas, crosses, flows if crosses else 1, slow,
            tensors=stage.variables, in_place=fused, crowded=crowded,
        )  # fmt: skip
        if crowded and p > 1 and layout.replicas > 1 and stage.param_bytes > 0:
            mates = [q for q in range(p) if q != s and stage_hosts[q] & stage_hosts[s]]
            reduce += _reduction_wakeups(s, stage.param_bytes, layout.replicas, finish, ends,
                                         parts, network.link(crosses), network, mates)  # fmt: skip
        update = slow * engine.optimizer(stage.variables, stage.param_bytes)
        if doubled[s] and stage.param_bytes > 0:
            # replicas on one core leave the collective a message apart: the first out
            # computes on (its update, then its next step's first action) and its core-mate's
            # last message waits for that rank's scheduler tick (docs/simulate.md)
            held = update + setup[s] + (forward[s] if s == 0 else 0.0)
            reduce += wake_wait(held, network.oversubscribed_wakeup)
        ends[s] = finish[s] + reduce + update
        parts[s] = (finish[s], reduce, update)
    slowest = max(range(p), key=ends.__getitem__)
    step = ends[slowest]
    if batch_logs:
        # every rank waits for the last stage's logs (its metric read-out), then all agree
        # on them and on stopping; without, the loop does so once an epoch
        logs_ready = max(ends[slowest], ends[-1] + slow * engine.step_fixed)
        sync = network.logs_sync(layout.world, layout.replicas, layout.nodes > 1, slow, crowded)
        step = logs_ready + sync
    return Prediction(
        layout=layout,
        global_batch=global_batch,
        step_time=step,
        pipeline_time=parts[slowest][0],
        allreduce_time=parts[slowest][1],
        optimizer_time=parts[slowest][2],
        between_steps_time=step - ends[slowest],
        bubble=bubble if p > 1 else 0.0,
        slowdown=slow,
        stage_starts=starts,
        stage_names=costs.start_names(starts),
        stage_compute=list(busy),
    )


def _reduction_wakeups(s, nbytes, replicas, finish, ends, parts, link, network, mates) -> float:
    """What stage `s`'s reduction waits on a node short of cores, where its ranks share cores
    with the ranks of the other stages on their nodes (`mates`; hyparflow deals every core a
    mix of stages): each message step of the allreduce finds its receivers' cores held by
    core-mates still computing, until their next scheduler tick or the end of their work
    (`sharing.wake_wait`). A mate computes until its own pipeline ends (if it has not reached
    its reduction yet: `ends[q]` None) or during its update (once through its reduction).
    The caller takes the stages in the order they finish."""
    steps = latency_steps(allreduce(nbytes, replicas, link)[1], replicas)
    start = finish[s]
    held = 0.0
    for q in mates:
        if ends[q] is None:  # still in its pipeline: computing its last actions
            held = max(held, finish[q] - start)
        else:  # its update runs from ends[q] - update to ends[q]
            held = max(held, ends[q] - max(start, ends[q] - parts[q][2]))
    waited = 0.0
    for _ in range(steps):
        if held <= 0:
            break
        wait = wake_wait(held, network.oversubscribed_wakeup)
        waited += wait
        held -= wait
    return waited


def _single_process(costs: ModelCosts, global_batch: int, machine: Machine) -> Prediction:
    slow = machine.slowdown(1)
    step = costs.single_process.at(global_batch) * slow
    return Prediction(
        layout=Layout(),
        global_batch=global_batch,
        step_time=step,
        pipeline_time=step,
        allreduce_time=0.0,
        optimizer_time=0.0,
        bubble=0.0,
        slowdown=slow,
        stage_starts=[0],
        stage_compute=[step],
        single_process=True,
    )


@functools.cache
def expected_maximum(count: int) -> float:
    """Expected largest of `count` independent standard normal variables (0 for one): how
    many standard deviations above the mean the slowest of `count` jittery replicas lands.

    Example:
        >>> round(expected_maximum(2), 4), round(expected_maximum(512), 2)
        (0.5642, 3.04)
    """
    if count <= 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 24001)
    below = 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x]))
    density = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    values = x * count * density * below ** (count - 1)
    step = x[1] - x[0]
    return float(step * (values.sum() - 0.5 * (values[0] + values[-1])))  # trapezoidal rule


def speedup(prediction: Prediction, baseline: Prediction) -> float:
    """Throughput relative to `baseline` (samples/s over samples/s)."""
    return prediction.throughput / baseline.throughput


def efficiency(prediction: Prediction, baseline: Prediction) -> float:
    """Speed-up per unit of resources, relative to what the baseline used: per rank when the
    baseline is one rank, per node when it fills one node."""
    base_units, units = _units(baseline, prediction)
    return speedup(prediction, baseline) * base_units / units


def _units(baseline: Prediction, prediction: Prediction) -> tuple[int, int]:
    if baseline.layout.world == 1:
        return 1, prediction.layout.world
    return baseline.nodes, prediction.nodes
