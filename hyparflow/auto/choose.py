"""`strategy="auto"` inside `hf.fit`: timed on rank 0, the network probed, one pick for all ranks.

The steps (docs/auto.md), each a collective that ends every rank alike if one fails:
1. rank 0 times the model (`simulate.measure.measure_model`, short: each layer's forward and
   backward at two batch sizes, the engine's costs; a model built under hf.scope(), which
   holds no weights to run, `simulate.by_layer`: each distinct layer built alone), while the
   others sleep;
2. ranks 0 and a neighbour on its node, then rank 0 and a rank on another node, ping-pong and
   allreduce (`simulate.netbench`, a fraction of a second);
3. rank 0 searches every layout (`search`) priced by the scaling model (`estimate`), each
   with its memory plan, within the budget, leaving out what `hf.fit` would refuse for this
   model, and only among the values of the fields the user left at their defaults;
4. every rank receives the pick, so all train with the same layout.

The costs are kept on the model, per world size, global batch and input shapes, and the pick
per world size, global batch and strategy: a second `hf.fit` with the same data does not time
the model again, and one with the same arguments does not search again.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

from hyparflow.auto.estimate import Estimator
from hyparflow.auto.search import (
    PRICED_SCHEDULES,
    SCHEDULES,
    VIRTUAL_STAGES,
    Candidate,
    SearchResult,
    candidates,
    search,
)
from hyparflow.comm.agree import agree
from hyparflow.comm.topology import node_map
from hyparflow.deferred import any_deferred
from hyparflow.memory.limits import cgroup_room, share_per_rank
from hyparflow.partitioner.graph import root_functional
from hyparflow.simulate.network import Link, Network
from hyparflow.simulate.predict import Machine
from hyparflow.strategy import Strategy

QUIET_POLL_SECONDS = 0.02  # how often a waiting rank looks whether rank 0 has finished
NETWORK_REPEATS = 5  # per message size: the probe is a sanity figure, not a benchmark
# timings per layer, and per stage step, loss and fused step (the simulator's own: 5 and 9);
# no plain model.fit baseline: only a one-rank prediction needs it
TIMING_REPEATS = (3, 3)
# besides P, R, T
SEARCHED = (
    "microbatches",
    "schedule",
    "recompute",
    "shard_optimizer",
    "shard_gradients",
    "shard_weights",
)
_PLANS_ATTRIBUTE = "_hyparflow_auto_plans"
_COSTS_ATTRIBUTE = "_hyparflow_auto_costs"
UNKNOWN_BATCH = (
    "the batch size is unknown before reading the data: a generator, a PyDataset or "
    "a Dataset with a partial last batch"
)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The layout picked (a resolved Strategy), the search behind it and the seconds spent."""

    strategy: Strategy
    result: SearchResult
    seconds: dict

    def line(self) -> str:
        """What rank 0 prints: the pick and runner-up, then where the planning time went."""
        spent = ", ".join(f"{name} {value:.1f} s" for name, value in self.seconds.items())
        return f"hyparflow {self.result.line()} (planned in {spent})"


@dataclasses.dataclass(frozen=True)
class Request:
    """What `hf.fit` asks the planner: an open "auto" `strategy`, the `global_batch` (None:
    unknown before the data is read), the inputs' shapes without the batch (`input_shape`,
    as `measure_model` takes them; None: the model's own), and `refusal(strategy)`, which
    raises ValueError for a layout `hf.fit` would refuse."""

    strategy: Strategy
    global_batch: int | None
    refusal: Callable[[Strategy], None]
    input_shape: object = None


class Untimeable(Exception):
    """The model could not be timed here (raised alike on every rank)."""


def planned_strategy(comm, model, request: Request, say: bool = True) -> Strategy:
    """The resolved Strategy to train `model` with: the planner's pick (`choose`), or data
    parallelism where it cannot time the model or the batch is unknown before the data is read;
    rank 0 prints which if `say`. Collective."""
    known = None if request.global_batch else UNKNOWN_BATCH
    unplannable = agree(comm, why_unplannable, model) or known
    try:
        choice = None if unplannable else choose(comm, model, request)
    except Untimeable as error:
        unplannable = f"it could not be timed: {error}"
    if unplannable:
        resolved = request.strategy.resolve(comm.Get_size())
        line = f"hyparflow auto: data parallel over {resolved.replicas} ranks ({unplannable})"
    else:
        resolved, line = choice.strategy, choice.line()
    if say and comm.Get_rank() == 0:
        print(line, flush=True)
    return resolved


def choose(comm, model, request: Request) -> Choice:
    """The layout for `model` on the ranks of `comm` (`Request`). Collective; the same Choice
    on every rank; raises `Untimeable` on every rank where the model could not be timed."""
    key = (comm.Get_size(), request.global_batch, repr(request.strategy))
    plans = _kept(model, _PLANS_ATTRIBUTE)
    if key not in plans:
        plans[key] = _choose(comm, model, request)
    return plans[key]


def _kept(model, name: str) -> dict:
    """The dict kept on `model` under `name` (made empty the first time)."""
    if getattr(model, name, None) is None:
        object.__setattr__(model, name, {})  # not a tracked attribute
    return getattr(model, name)


def why_unplannable(model) -> str | None:
    """Why the planner cannot time `model` (then data parallelism is the layout), or None."""
    try:
        root_functional(model)
    except ValueError:
        return "not a layer graph, so it cannot be cut into stages"
    return None


def last_choice(model, world: int) -> Choice | None:
    """The most recent Choice `hf.fit` made for `model` on `world` ranks (evaluate and predict
    run on it), or None."""
    found = [
        choice for (size, *_), choice in _kept(model, _PLANS_ATTRIBUTE).items() if size == world
    ]
    return found[-1] if found else None


def _choose(comm, model, request: Request) -> Choice:
    started, world = time.perf_counter(), comm.Get_size()
    nodes, _ = node_map(comm)
    costs = _costs(comm, model, request)
    timed = time.perf_counter()
    network = _probe(comm, nodes)
    probed = time.perf_counter()
    on_node = nodes.count(nodes[0])
    budget = request.strategy.memory_per_rank or _cgroup_share(comm, nodes)
    layout = (world, request.global_batch, on_node if max(nodes) > 0 else None)
    result = _on_rank_zero(comm, _search, model, request, layout, costs, network, budget)
    result = comm.bcast(result, root=0)
    options = result.pick.candidate.strategy_options()
    picked = dataclasses.replace(request.strategy, **options).resolve(world)
    seconds = {
        "timing": timed - started,
        "network": probed - timed,
        "search": time.perf_counter() - probed,
    }
    return Choice(picked, result, seconds)


def _costs(comm, model, request: Request):
    """Rank 0's costs of `model` (None on the others), timed once per world size, batch and
    input shapes; raises `Untimeable` on every rank where the model could not be timed."""
    key = (comm.Get_size(), request.global_batch, repr(request.input_shape))
    timed = _kept(model, _COSTS_ATTRIBUTE)
    if key not in timed:
        world = comm.Get_size()
        costs, failure = _on_rank_zero(comm, _measure, model, request, world) or (None, None)
        timed[key] = costs, comm.bcast(failure, root=0)
    costs, failure = timed[key]
    if failure:
        raise Untimeable(failure)
    return costs


def _on_rank_zero(comm, work, *args):
    """`work(*args)` on rank 0, its result (or error) agreed by all; the other ranks sleep
    meanwhile rather than spin in MPI, so that rank 0's timings have the node to themselves."""
    try:
        outcome = (work(*args) if comm.Get_rank() == 0 else None), None
    except Exception as error:  # noqa: BLE001 - agreed below, on every rank
        outcome = None, error
    arrived = comm.Ibarrier()
    while not arrived.Test():
        time.sleep(QUIET_POLL_SECONDS)
    return agree(comm, _unpacked, outcome)


def _unpacked(outcome):
    result, error = outcome
    if error is not None:
        raise error
    return result


def _measure(model, request: Request, world: int):
    """(This rank's costs of `model` at the micro-batch sizes the layouts will run, None), or
    (None, why it could not be timed)."""
    from hyparflow.auto.planner_costs import with_planner_costs  # TensorFlow: only now

    small, large = timing_batches(request.global_batch, world)
    try:
        costs = _timed(model, (small, large), request.input_shape)
        costs = with_planner_costs(
            costs, model, small, request.input_shape, least_factor(world), TIMING_REPEATS[1]
        )
    except Exception as error:  # noqa: BLE001 - any failure: data parallelism, said why
        return None, f"{type(error).__name__}: {error}"
    return costs, None


def _timed(model, batches, input_shape):
    """`model`'s costs: whole (`measure_model`, its stage splits run), or layer by layer
    (`by_layer`) where it holds no weights to run (hf.scope()) or running its stages fails
    (keras_hub's Llama: TensorFlow's tape cannot differentiate one of its stage splits)."""
    from hyparflow.simulate.by_layer import measure_by_layer
    from hyparflow.simulate.measure import measure_model

    if not any_deferred(model):
        try:
            return measure_model(model, batches, input_shape, (), repeats=TIMING_REPEATS)
        except Exception:  # noqa: BLE001 - timed layer by layer instead; if that fails, said
            pass
    return measure_by_layer(model, batches, input_shape, TIMING_REPEATS[0])


def timing_batches(global_batch: int, world: int) -> tuple[int, int]:
    """The two batch sizes a model is timed at: a quarter of one rank's share of the global
    batch and all of it (at least 1 and 2), the micro-batches its layouts run.

    Example:
        >>> timing_batches(64, 4), timing_batches(64, 64)
        ((4, 16), (1, 2))
    """
    small = max(1, global_batch // (4 * world))
    return small, max(small + 1, global_batch // world)


def least_factor(world: int) -> int:
    """The fewest tensor ranks above one that divide `world` (the layout the timing prices)."""
    return next(t for t in range(2, world + 1) if world % t == 0) if world > 1 else 1


def _probe(comm, nodes: list[int]) -> Network | None:
    """Rank 0's network (None elsewhere): a ping-pong with the next rank of its node and with
    the first rank of another node, those that exist; a node's link stands for both if only
    one was measured. Collective."""
    same = next((r for r, n in enumerate(nodes) if r and n == nodes[0]), None)
    other = next((r for r, n in enumerate(nodes) if n != nodes[0]), None)
    intra, inter = _pingpong(comm, same), _pingpong(comm, other)
    if comm.Get_rank() != 0:
        return None
    first = intra or inter
    link = functools.partial(_link, first=first)
    return Network(
        intra=link(intra),
        inter=link(inter) if inter else None,
        reduce_rate=first["reduce_rate"] or float("inf"),
        source={"measured": "hf.fit auto"},
    )


def _link(measured: dict | None, first: dict) -> Link:
    fields = (measured or first)["intra"]
    return Link(fields["latency"], fields["bandwidth"])


def _pingpong(comm, partner: int | None) -> dict | None:
    """`netbench.run` between rank 0 and `partner` (None: nobody measures); rank 0 gets the
    fitted network fields. Collective over `comm` (its Split)."""
    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    from hyparflow.simulate import netbench

    rank = comm.Get_rank()
    taking_part = partner is not None and rank in (0, partner)
    pair = comm.Split(0 if taking_part else MPI.UNDEFINED, rank)
    if pair == MPI.COMM_NULL:
        return None
    try:
        return netbench.run(pair, repeats=NETWORK_REPEATS)
    finally:
        pair.Free()


# of the room a cgroup leaves, what the plan may fill: it measured up to 17% low on engine
# ranks (what grows outside TensorFlow's allocator, docs/memory.md), and a rank over its
# cgroup's limit is killed, not slowed
CGROUP_HEADROOM = 0.8


def _cgroup_share(comm, nodes: list[int]) -> int | None:
    """Bytes each rank may still take under the cgroup limits (None without any): a cgroup's
    room shared by the ranks of the node inside it, the least over ranks, less the plan's
    error (`CGROUP_HEADROOM`). Collective."""
    mine = (nodes[comm.Get_rank()], cgroup_room())
    share = share_per_rank(comm.allgather(mine))
    return None if share is None else int(share * CGROUP_HEADROOM)


def _search(model, request: Request, layout, costs, network, budget) -> SearchResult:
    """Rank 0's search over `layout` = (world, global batch, ranks per node or None)."""
    world, global_batch, ranks_per_node = layout
    strategy = request.strategy
    memory = memory_of(model, global_batch, strategy)

    def allowed(candidate: Candidate) -> int:  # the estimator's bytes, after hf.fit's refusals
        request.refusal(_strategy_of(strategy, candidate))
        return memory(candidate)

    estimate = Estimator(
        costs,
        network,
        global_batch,
        machine=Machine(None),
        memory=allowed,
        ranks_per_node=ranks_per_node,
    )
    schedule = strategy.set_fields().get("schedule")
    schedules = (schedule,) if schedule in PRICED_SCHEDULES else SCHEDULES
    found = candidates(
        world,
        global_batch,
        layers=len(costs.layers),
        schedules=schedules,
        virtual_stages=max(strategy.virtual_stages, VIRTUAL_STAGES),
    )
    layouts = _keeping_user_fields(found, strategy)
    return search(layouts, estimate, global_batch, budget, bound=estimate.bound)


def _keeping_user_fields(layouts: list[Candidate], strategy: Strategy) -> list[Candidate]:
    """The layouts that keep every searched field the user set (e.g. `shard_optimizer=True`)."""
    fixed = {k: v for k, v in strategy.set_fields().items() if k in SEARCHED}

    def keeps(c: Candidate, name: str, value) -> bool:
        # a schedule acts only where there is a pipeline: it leaves P = 1 layouts in the search
        return getattr(c, name) == value or (name == "schedule" and c.partitions == 1)

    return [c for c in layouts if all(keeps(c, k, v) for k, v in fixed.items())]


def _strategy_of(strategy: Strategy, candidate: Candidate) -> Strategy:
    return dataclasses.replace(strategy, **candidate.strategy_options())


def memory_of(model, batch_size: int, base: Strategy | None = None, whole_model=None):
    """A function of a layout: its peak bytes on the fullest rank, the memory plan of `model`
    under `base` (default: Strategy's defaults) with the layout's fields; `whole_model` as
    `memory_plan` takes it (None: from the model's build)."""
    from hyparflow.memory import memory_plan  # imports Keras: only with a model

    base, splits = base or Strategy(), {}  # each stage split made once for all layouts

    @functools.cache
    def memory(candidate: Candidate) -> int:
        strategy = _strategy_of(base, candidate)
        plan = memory_plan(
            model,
            strategy,
            batch_size=batch_size,
            whole_model=whole_model,
            splits=splits,
            every_replica=False,  # the largest rank is among the first two replicas
        )
        return plan.largest.total

    return memory
