"""Step time, throughput and efficiency of P partitions x R replicas, from costs and a network.

A step of hyparflow's engine (docs/engine.md) is, on every rank: the pipeline schedule over
the micro-batches (`schedule.simulate` with per-stage forward and backward times and
the link delay), the sum of the stage's gradients over its replicas (`network.py`), then the
optimizer; the slowest stage sets the step. Every rank is assumed to have a core of its own.
With jitter, a stage's replicas meet at their allreduce when the slowest arrives (the expected
maximum of R normal variables; Dean and Barroso, "The Tail at Scale", CACM 56(2), 2013).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from hyparflow.schedule import make_schedule, simulate
from hyparflow.simulate.costs import EngineCosts, ModelCosts, StageCost
from hyparflow.simulate.network import Link, Network
from hyparflow.simulate.placement import Layout


@dataclass(frozen=True)
class Machine:
    """The nodes' processors: `cores_per_node` (None: as many as the ranks need) and `jitter`,
    the coefficient of variation of a rank's compute per step (operating-system noise,
    interference: the replicas of a stage wait for the slowest at their allreduce)."""

    cores_per_node: int | None = None
    jitter: float = 0.0

    def check(self, layout: Layout) -> None:
        """Refuse a layout that puts more ranks on a node than it has cores."""
        ranks = layout.per_node
        if self.cores_per_node is not None and ranks > self.cores_per_node:
            raise ValueError(
                f"{ranks} ranks on a node of {self.cores_per_node} cores: the model assumes a "
                f"core per rank; use --ranks-per-node {self.cores_per_node} or more nodes"
            )


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
    between_steps_time: float = 0.0  # the loop's logs and agreement after the step
    stage_starts: list[int] = field(default_factory=list)
    stage_names: list[str] = field(default_factory=list)
    stage_compute: list[float] = field(default_factory=list)  # forward + backward per step
    single_process: bool = False  # one rank runs plain model.fit

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.global_batch / self.step_time

    def to_dict(self) -> dict:
        data = asdict(self)
        layout = data.pop("layout")
        layout["ranks_per_node"] = self.layout.ranks_per_node or self.layout.world
        return {**layout, "nodes": self.layout.nodes, **data, "throughput": self.throughput}


def microbatch_size(global_batch: int, layout: Layout) -> int:
    """Samples per micro-batch; the engine needs the global batch to split evenly."""
    per_batch = layout.replicas * layout.microbatches  # micro-batches of one global batch
    if global_batch % per_batch:
        valid = max(per_batch, global_batch // per_batch * per_batch)
        raise ValueError(
            f"a global batch of {global_batch} does not split into {layout.replicas} replicas "
            f"x {layout.microbatches} micro-batches; use a multiple of {per_batch}, e.g. {valid}"
        )
    return global_batch // per_batch


def predict(
    costs: ModelCosts,
    network: Network,
    layout: Layout,
    global_batch: int,
    machine: Machine = Machine(),
    starts: list[int] | None = None,
    batch_logs: bool = False,
    shard_optimizer: bool = False,
    shard_gradients: bool = False,
    shard_weights: bool = False,
) -> Prediction:
    """Predict one training step of `layout` on `global_batch` samples.

    One rank in all runs plain `model.fit` (`costs.single_process`, when measured). `starts`
    fixes where stages begin (layer indices; default: balanced by time). `batch_logs`: a
    callback reads every batch's logs (verbose=1, `ScalingProfiler`), so after each step the
    last stage reads its metrics out and all ranks agree on the logs and on stopping.
    `shard_optimizer`: ZeRO-1 over the replicas (`sharded_update`); `shard_gradients`: ZeRO-2,
    whose every micro-batch reduce-scatters its gradients (M reduce-scatters a step, each half
    an allreduce's bytes, instead of one); `shard_weights`: ZeRO-3, whose every micro-batch
    all-gathers the weights twice (its forward, its backward's recomputation: pass costs that
    recompute) and whose update gathers nothing.

    For example:
        p = predict(costs, Network(intra=Link(1e-6, 10e9)), Layout(2, 2, 4), 256)
    """
    machine.check(layout)
    if layout.world == 1 and costs.single_process is not None:
        return _single_process(costs, global_batch)
    batch = microbatch_size(global_batch, layout)
    p, v = layout.partitions, layout.chunks
    if p * v > len(costs.layers):
        raise ValueError(
            f"{costs.name} has {len(costs.layers)} layers: it cannot be cut into {p * v} "
            "model chunks; use fewer partitions" + (" or virtual stages" if v > 1 else "")
        )
    starts = list(starts) if starts is not None else costs.split(p * v, batch)
    bounds = [*starts, len(costs.layers)]
    # one cost per model chunk (interleaved: stage s holds chunks s, s + p, ...)
    chunks = [costs.stage(a, b, batch) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    stages = [_merged(chunks[s::p]) for s in range(p)]

    sim = _pipeline(costs, network, layout, chunks, bounds, batch)
    finish = [0.0] * p
    for (s, _), (_, end) in sim.times.items():
        finish[s] = max(finish[s], end)

    straggle = 1.0 + machine.jitter * expected_maximum(layout.replicas)
    flows = layout.offnode_reductions_per_node()
    reduce_and_update = functools.partial(
        _reduce_and_update,
        flows=flows,
        engine=costs.engine,
        network=network,
        replicas=layout.replicas,
        shard_optimizer=shard_optimizer,
        scatters=layout.microbatches if shard_gradients or shard_weights else 1,
        gathers=2 * layout.microbatches if shard_weights else 1,
    )
    parts = [
        (finish[s] * straggle, *reduce_and_update(stage, layout.stage_nodes(s) > 1))
        for s, stage in enumerate(stages)
    ]
    ends = [sum(part) for part in parts]
    slowest = max(range(p), key=ends.__getitem__)
    step = ends[slowest]
    if batch_logs:
        # every rank waits for the last stage's logs (its metric read-out), then all agree
        # on them and on stopping; without, the loop does so once an epoch
        step = max(step, ends[-1] + costs.engine.step_fixed)
        step += network.logs_sync(layout.world, layout.replicas, layout.nodes > 1)
    pipeline, reduce, update = parts[slowest]
    bubble = sim.bubble if p > 1 else 0.0
    times = (step, pipeline, reduce, update, bubble, step - ends[slowest])
    names = costs.start_names(starts)
    return Prediction(layout, global_batch, *times, starts, names, list(sim.busy))


def _pipeline(costs: ModelCosts, network: Network, layout: Layout, chunks, bounds, batch: int):
    """The schedule's simulation of the model chunks (cut at `bounds`) on `layout`."""
    p, v = layout.partitions, layout.chunks
    forward, backward, weight = _pass_times(costs, chunks, layout, batch)
    # one link delay for the simulator: the slowest (every chunk boundary crosses stages) is safe
    crosses = [layout.pipeline_link_crosses_nodes(k % p) for k in range(p * v - 1)]
    transfers = [
        network.link(c).time(costs.cut_bytes[bounds[k + 1]] * batch) for k, c in enumerate(crosses)
    ]
    delay = max(transfers, default=0.0)
    passes = (tuple(forward), tuple(backward), delay, tuple(weight) or None)
    return _simulated(layout.schedule, p, layout.microbatches, *passes, v)


def _merged(chunks: list[StageCost]) -> StageCost:
    """One stage's costs from its model chunks' (what its reduction and update handle)."""
    return StageCost(
        *(
            sum(getattr(c, name) for c in chunks)
            for name in ("forward", "backward", "param_bytes", "variables", "weight_backward")
        )
    )


def _pass_times(costs: ModelCosts, chunks: list[StageCost], layout: Layout, batch: int):
    """Each model chunk's seconds per micro-batch (a stage's, but for an interleaved model):
    forward, backward and (ZB-H1's W, a call of its own, split off the backward) weight
    passes, the engine's costs included; every chunk pays its own engine calls."""
    engine, p, m = costs.engine, layout.partitions, layout.microbatches
    fused = p == 1 and costs.fused is not None  # the engine's one-call step, flat gradients
    split = layout.schedule == "zero_bubble" and p > 1
    last = len(chunks) - 1
    forward, backward, weight = [], [], []
    for s, stage in enumerate(chunks):
        f = stage.forward + engine.forward_call + (engine.loss.at(batch) if s == last else 0)
        b = stage.backward + engine.backward_call
        if fused:
            f, b = costs.fused.at(batch), 0.0
        forward.append(f)
        summed = engine.accumulate_per_byte * stage.param_bytes * (m - 1) / m
        if split:
            weight.append(stage.weight_backward + engine.backward_call + summed)
            b, summed = b - stage.weight_backward, 0.0
        backward.append(b + summed)
    return forward, backward, weight


def _reduce_and_update(
    stage: StageCost,
    crosses: bool,
    flows: int,
    engine: EngineCosts,
    network: Network,
    replicas: int,
    shard_optimizer: bool,
    scatters: int = 1,
    gathers: int = 1,
):
    """A stage's sum of gradients over its `replicas` (over nodes if it `crosses` them, where
    `flows` reductions share a node's link) and its optimizer update, in seconds. `scatters`:
    reduce-scatters a step sends (ZeRO-2: one per micro-batch), `gathers` its all-gathers of
    the weights (ZeRO-1: one after the update; ZeRO-3: two per micro-batch), each half an
    allreduce."""
    reduce = network.gradient_allreduce(
        stage.param_bytes, replicas, crosses, flows if crosses else 1
    )
    reduce *= (gathers + scatters) / 2
    if shard_optimizer and replicas > 1:
        return reduce, sharded_update(engine, stage, replicas, network.link(crosses))
    return reduce, engine.optimizer(stage.variables, stage.param_bytes)


def sharded_update(engine: EngineCosts, stage: StageCost, replicas: int, link: Link) -> float:
    """ZeRO-1's update of a stage (`engine/sharded_optimizer/sharded_update.py`): the optimizer
    steps one flat slice of 1/R of the parameters, the host moves every parameter byte through its
    buffers (the measured `sharded_update_per_byte`), and each variable's pieces are broadcast by
    the replicas holding them (a binomial tree each; its bytes are the allreduce's second half,
    already counted)."""
    if not stage.variables:
        return 0.0
    broadcasts = stage.variables * math.ceil(math.log2(replicas)) * link.latency
    host = engine.sharded_update_per_byte * stage.param_bytes
    return engine.optimizer(1, stage.param_bytes / replicas) + host + broadcasts


@functools.lru_cache(maxsize=16)
def _simulated(
    schedule: str,
    p: int,
    m: int,
    forward: tuple,
    backward: tuple,
    delay: float,
    weight: tuple | None,
    virtual_stages: int = 1,
):
    """The schedule's simulation, kept for the layouts that share it (ZeRO-1 and without)."""
    weights = None if weight is None else list(weight)
    return simulate(
        make_schedule(schedule, p, m, virtual_stages),
        list(forward),
        list(backward),
        delay,
        weight_time=weights,
    )


def _single_process(costs: ModelCosts, global_batch: int) -> Prediction:
    step = costs.single_process.at(global_batch)
    return Prediction(
        Layout(), global_batch, step, step, 0.0, 0.0, 0.0, 0.0, [0], [], [step], single_process=True
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
    if baseline.layout.world == 1:
        return speedup(prediction, baseline) / prediction.layout.world
    return speedup(prediction, baseline) * baseline.layout.nodes / prediction.layout.nodes
