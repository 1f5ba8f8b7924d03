"""The planner's estimator: a layout's step time from the scaling model, its bytes from a plan.

`search.search` ranks layouts by what an estimator says of each, skipping those whose
`bound` (their compute alone) is already slower than the best found. This one asks
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


class Estimator:
    """Each candidate's `Estimate` for `global_batch` samples per step (call it), and a
    `bound` on its step time that costs no simulation. `memory(candidate)` gives its peak bytes
    per rank (None: 0, for a search without a budget). A pipeline's prediction is shared by
    its ZeRO-1 twin."""

    def __init__(
        self, costs: ModelCosts, network: Network, global_batch: int, *,
        machine: Machine | None = None, memory: Callable[[Candidate], int] | None = None,
        ranks_per_node: int | None = None,
    ):  # fmt: skip
        self.costs, self.network, self.global_batch = costs, network, global_batch
        self.machine = machine or Machine()
        self.memory, self.ranks_per_node = memory, ranks_per_node
        self.recomputing = _recomputing(costs)
        # every layer's forward plus backward as one line in the batch, for `bound`
        self._whole = {False: _whole(costs), True: _whole(self.recomputing)}
        self._predictions = {}

    def __call__(self, candidate: Candidate) -> Estimate:
        if candidate.tensor > 1:
            raise ValueError("the scaling model has no cost for tensor parallelism yet")
        prediction = self._prediction(candidate)
        step = prediction.step_time
        if candidate.shard_optimizer:
            step -= prediction.optimizer_time * (1 - 1 / candidate.replicas)
        return Estimate(step, 0 if self.memory is None else int(self.memory(candidate)))

    def bound(self, candidate: Candidate) -> float:
        """Seconds no prediction of `candidate` goes below: its compute alone. A stage does one
        micro-batch at a time, so the busiest of P stages computes at least m/P of every
        micro-batch's forward and backward, and the first micro-batch passes through all of
        them; replicas only add their allreduce, ZeRO-1 saves only optimizer time. 0 where the
        prediction is not the layers' (one rank's plain fit, tensor ranks)."""
        p, m = candidate.partitions, candidate.microbatches
        if candidate.world == 1 or candidate.tensor > 1:
            return 0.0
        costs = self.recomputing if candidate.recompute else self.costs
        batch = self.global_batch / (candidate.replicas * m)
        if p == 1 and costs.fused is not None:  # the engine's one-call step
            return m * costs.fused.at(batch)
        whole = self._whole[candidate.recompute].at(batch)
        return max(whole, m * whole / p)

    def _prediction(self, candidate: Candidate):
        key = (candidate.partitions, candidate.replicas, candidate.microbatches,
               candidate.schedule, candidate.recompute)  # fmt: skip
        if key not in self._predictions:
            layout = Layout(*key[:4], self.ranks_per_node)
            priced = self.recomputing if candidate.recompute else self.costs
            self._predictions[key] = predict(
                priced, self.network, layout, self.global_batch, self.machine
            )  # fmt: skip
        return self._predictions[key]


def _whole(costs: ModelCosts) -> Affine:
    """Every layer's forward plus backward, summed."""
    return Affine(
        sum(layer.forward.fixed + layer.backward.fixed for layer in costs.layers),
        sum(layer.forward.per_sample + layer.backward.per_sample for layer in costs.layers),
    )


def _recomputing(costs: ModelCosts) -> ModelCosts:
    """`costs` with each layer's forward run again in its backward, as `recompute` does."""

    def again(layer):
        backward = Affine(
            layer.backward.fixed + layer.forward.fixed,
            layer.backward.per_sample + layer.forward.per_sample,
        )
        return replace(layer, backward=backward)

    return replace(costs, layers=[again(layer) for layer in costs.layers])
