"""`strategy="auto"` inside `hf.fit`: timed on rank 0, the network probed, one pick for all ranks.

The steps (docs/auto.md), each a collective that ends every rank alike if one fails:
1. rank 0 times the model (`simulate.measure.measure_model`: each layer's forward and backward
   at two batch sizes, the engine's costs, a plain Keras step), while the others wait;
2. ranks 0 and a neighbour on its node, then rank 0 and a rank on another node, ping-pong and
   allreduce (`simulate.netbench`, a fraction of a second);
3. rank 0 searches every layout (`search`) priced by the scaling model (`estimate`), each
   with its memory plan, within the budget, leaving out what `hf.fit` would refuse for this
   model, and only among the values of the fields the user left at their defaults;
4. every rank receives the pick, so all train with the same layout.

The result is kept on the model, per world size, global batch and strategy, so a second
`hf.fit` with the same arguments does not time the model again.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

from hyparflow.auto.estimate import estimator
from hyparflow.auto.search import Candidate, SearchResult, candidates, search
from hyparflow.comm.agree import agree
from hyparflow.comm.topology import node_map
from hyparflow.deferred import any_deferred
from hyparflow.memory.limits import memory_limit
from hyparflow.partitioner.graph import root_functional
from hyparflow.simulate.network import Link, Network
from hyparflow.simulate.predict import Machine
from hyparflow.strategy import Strategy

NETWORK_REPEATS = 5  # per message size: the probe is a sanity figure, not a benchmark
SEARCHED = ("microbatches", "schedule", "recompute", "shard_optimizer")  # besides P, R, T
_PLANS_ATTRIBUTE = "_hyparflow_auto_plans"


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


def planned_strategy(
    comm, model, strategy: Strategy, global_batch: int, refusal: Callable[[Strategy], None],
    say: bool = True,
) -> Strategy:  # fmt: skip
    """The resolved Strategy to train `model` with: the planner's pick (`choose`), or data
    parallelism where it cannot time the model; rank 0 prints which if `say`. Collective."""
    unplannable = agree(comm, why_unplannable, model)
    if unplannable:
        resolved = strategy.resolve(comm.Get_size())
        line = f"hyparflow auto: data parallel over {resolved.replicas} ranks ({unplannable})"
    else:
        choice = choose(comm, model, strategy, global_batch, refusal)
        resolved, line = choice.strategy, choice.line()
    if say and comm.Get_rank() == 0:
        print(line, flush=True)
    return resolved


def choose(comm, model, strategy: Strategy, global_batch: int,
           refusal: Callable[[Strategy], None]) -> Choice:  # fmt: skip
    """The layout for `model` on the ranks of `comm` at `global_batch` samples per step, from
    an open "auto" `strategy` (`Strategy.leaves_layout_open`). `refusal(strategy)` raises
    ValueError for a layout `hf.fit` would refuse. Collective; the same Choice on every rank."""
    key = (comm.Get_size(), global_batch, repr(strategy))
    plans = getattr(model, _PLANS_ATTRIBUTE, None)
    if plans is None:
        plans = {}
        object.__setattr__(model, _PLANS_ATTRIBUTE, plans)  # not a tracked attribute
    if key not in plans:
        plans[key] = _choose(comm, model, strategy, global_batch, refusal)
    return plans[key]


def why_unplannable(model) -> str | None:
    """Why the planner cannot time `model` (then data parallelism is the layout), or None."""
    if any_deferred(model):
        return "a model built under hf.scope() holds no weights to time; give a layout"
    try:
        root_functional(model)
    except ValueError:
        return "not a layer graph, so it cannot be cut into stages"
    return None


def last_choice(model, world: int) -> Choice | None:
    """The most recent Choice `hf.fit` made for `model` on `world` ranks (evaluate and predict
    run on it), or None."""
    plans = getattr(model, _PLANS_ATTRIBUTE, {})
    found = [choice for (size, _, _), choice in plans.items() if size == world]
    return found[-1] if found else None


def _choose(comm, model, strategy, global_batch, refusal) -> Choice:
    rank, started = comm.Get_rank(), time.perf_counter()
    nodes, _ = node_map(comm)
    costs = agree(comm, _measure if rank == 0 else _nothing, model, global_batch, comm.Get_size())
    timed = time.perf_counter()
    network = _probe(comm, nodes)
    probed = time.perf_counter()
    on_node = nodes.count(nodes[0])
    budget = strategy.memory_per_rank or _cgroup_share(on_node)
    search_on_zero = _search if rank == 0 else _nothing
    layout = (comm.Get_size(), global_batch, on_node if max(nodes) > 0 else None)
    result = agree(comm, search_on_zero, model, strategy, layout, costs, network, budget, refusal)
    result = comm.bcast(result, root=0)
    options = result.pick.candidate.strategy_options()
    picked = dataclasses.replace(strategy, **options).resolve(comm.Get_size())
    seconds = {
        "timing": timed - started, "network": probed - timed,
        "search": time.perf_counter() - probed,
    }  # fmt: skip
    return Choice(picked, result, seconds)


def _nothing(*_):
    return None


def _measure(model, global_batch: int, world: int):
    """This rank's costs of `model` at the micro-batch sizes the layouts will run."""
    from hyparflow.simulate.measure import measure_model  # imports TensorFlow: only now

    small = max(1, global_batch // (4 * world))
    large = max(small + 1, global_batch // world)
    return measure_model(model, (small, large), fit_batch_sizes=(small, global_batch))


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
        intra=link(intra), inter=link(inter) if inter else None,
        reduce_rate=first["reduce_rate"] or float("inf"), source={"measured": "hf.fit auto"},
    )  # fmt: skip


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


def _cgroup_share(ranks_on_node: int) -> int | None:
    """Bytes per rank of this process's cgroup limit (None without one), shared by the ranks
    of the node."""
    limit = memory_limit()
    return None if limit is None else limit // ranks_on_node


def _search(model, strategy, layout, costs, network, budget, refusal) -> SearchResult:
    """Rank 0's search over `layout` = (world, global batch, ranks per node or None)."""
    world, global_batch, ranks_per_node = layout
    memory = memory_of(model, global_batch, strategy)

    def allowed(candidate: Candidate) -> int:  # the estimator's bytes, after hf.fit's refusals
        refusal(_strategy_of(strategy, candidate))
        return memory(candidate)

    estimate = estimator(
        costs, network, global_batch, machine=Machine(None), memory=allowed,
        ranks_per_node=ranks_per_node,
    )  # fmt: skip
    layouts = candidates(world, global_batch, layers=len(costs.layers))
    layouts = _keeping_user_fields(layouts, strategy)
    return search(layouts, estimate, global_batch, budget, bound=estimate.bound)


def _keeping_user_fields(layouts: list[Candidate], strategy: Strategy) -> list[Candidate]:
    """The layouts that keep every searched field the user set (e.g. `shard_optimizer=True`)."""
    fixed = {k: v for k, v in strategy.set_fields().items() if k in SEARCHED}
    return [c for c in layouts if all(getattr(c, k) == v for k, v in fixed.items())]


def _strategy_of(strategy: Strategy, candidate: Candidate) -> Strategy:
    return dataclasses.replace(strategy, **candidate.strategy_options())


def memory_of(model, batch_size: int, base: Strategy | None = None):
    """A function of a layout: its peak bytes on the fullest rank, the memory plan of `model`
    under `base` (default: Strategy's defaults) with the layout's fields."""
    from hyparflow.memory import memory_plan  # imports Keras: only with a model

    base = base or Strategy()

    @functools.cache
    def memory(candidate: Candidate) -> int:
        strategy = _strategy_of(base, candidate)
        return memory_plan(model, strategy, batch_size=batch_size).largest.total

    return memory
