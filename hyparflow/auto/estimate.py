"""The planner's estimator: a layout's step time from the scaling model, its bytes from a plan.

`search.search` ranks layouts by what an estimator says of each. This one asks
`predict.predict` (measured per-layer costs, an alpha-beta network, the schedule simulator)
for the step time, and a memory function (in hyparflow, `memory_plan` of the model) for the
peak bytes of the fullest rank. What the scaling model cannot price is refused with the reason,
so the search lists it among the rejected layouts instead of guessing:

- tensor ranks (T > 1): the model has no cost of a split layer's exchanges yet;
- a layout the engine cannot run (a batch that does not split, more stages than layers).

ZeRO-1 (`shard_optimizer`) moves the same bytes as the allreduce it replaces (a
reduce-scatter, then an all-gather of the updated slices), and each replica updates 1/R of the
stage's variables: the step is the prediction's with the optimizer's time divided by R.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hyparflow.auto.search import Candidate, Estimate
from hyparflow.simulate.costs import Affine, ModelCosts
from hyparflow.simulate.network import Network
from hyparflow.simulate.placement import Layout
from hyparflow.simulate.predict import Machine, predict


def estimator(
    costs: ModelCosts, network: Network, global_batch: int, *, machine: Machine | None = None,
    memory: Callable[[Candidate], int] | None = None, ranks_per_node: int | None = None,
) -> Callable[[Candidate], Estimate]:  # fmt: skip
    """A function giving each candidate's `Estimate` for `global_batch` samples per step:
    `memory(candidate)` its peak bytes per rank (None: 0, for a search without a budget)."""

    recomputing, machine = _recomputing(costs), machine or Machine()

    def estimate(candidate: Candidate) -> Estimate:
        if candidate.tensor > 1:
            raise ValueError("the scaling model has no cost for tensor parallelism yet")
        layout = Layout(
            candidate.partitions, candidate.replicas, candidate.microbatches,
            candidate.schedule, ranks_per_node,
        )  # fmt: skip
        priced = recomputing if candidate.recompute else costs
        prediction = predict(priced, network, layout, global_batch, machine)
        step = prediction.step_time
        if candidate.shard_optimizer:
            step -= prediction.optimizer_time * (1 - 1 / candidate.replicas)
        return Estimate(step, 0 if memory is None else int(memory(candidate)))

    return estimate


def _recomputing(costs: ModelCosts) -> ModelCosts:
    """`costs` with each layer's forward run again in its backward, as `recompute` does."""

    def again(layer):
        backward = Affine(
            layer.backward.fixed + layer.forward.fixed,
            layer.backward.per_sample + layer.forward.per_sample,
        )
        return replace(layer, backward=backward)

    return replace(costs, layers=[again(layer) for layer in costs.layers])
