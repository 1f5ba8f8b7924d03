"""The planner's estimator: a layout's step time from the scaling model, its bytes from a plan.

`search.search` ranks layouts by what an estimator says of each, skipping those whose
`bound` (their compute alone) is already slower than the best found. This one asks
`predict.predict` (measured per-layer costs, an alpha-beta network, the schedule simulator)
for the step time, and a memory function (in hyparflow, `memory_plan` of the model) for the
peak bytes of the fullest rank.

Tensor ranks are priced by `auto.tensor_price`: each rank of a group of T pays 1/T of its
split layers' work and weights, plus the allreduces of their activations, from the
`TensorShare`s the timing measured (costs measured without them refuse T > 1, saying so).
ZeRO-1 (`shard_optimizer`) is `predict`'s `sharded_update`: a slice's optimizer step plus the
host copies and broadcasts it costs; ZeRO-2 (`shard_gradients`) adds a reduce-scatter per
micro-batch; ZeRO-3 (`shard_weights`) two all-gathers per micro-batch and the recomputed
forward. A layout the engine cannot run (a batch that does not
split, more stages than layers) is refused with the reason, so the search lists it among the
rejected layouts instead of guessing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hyparflow.auto.search import Candidate, Estimate
from hyparflow.auto.tensor_price import tensor_costs
from hyparflow.simulate.costs import Affine, ModelCosts
from hyparflow.simulate.network import Network
from hyparflow.simulate.placement import Layout
from hyparflow.simulate.predict import Machine, predict


class Estimator:
    """Each candidate's `Estimate` for `global_batch` samples per step (call it), and a
    `bound` on its step time that costs no simulation. `memory(candidate)` gives its peak bytes
    per rank (None: 0, for a search without a budget). Per-layer costs are priced once per
    (recompute, tensor ranks), predictions once per layout."""

    def __init__(
        self,
        costs: ModelCosts,
        network: Network,
        global_batch: int,
        *,
        machine: Machine | None = None,
        memory: Callable[[Candidate], int] | None = None,
        ranks_per_node: int | None = None,
    ):
        self.costs, self.network, self.global_batch = costs, network, global_batch
        self.machine = machine or Machine()
        self.memory, self.ranks_per_node = memory, ranks_per_node
        self._priced, self._recomputed, self._predictions = {}, {}, {}
        self._whole, self._weight = {}, {}  # per (recompute, tensor): lines in the batch

    def __call__(self, candidate: Candidate) -> Estimate:
        step = self._prediction(candidate).step_time
        return Estimate(step, 0 if self.memory is None else int(self.memory(candidate)))

    def bound(self, candidate: Candidate) -> float:
        """Seconds no prediction of `candidate` goes below: its compute alone. A stage does one
        micro-batch at a time, so the busiest of P stages computes at least m/P of every
        micro-batch's forward and backward, and the first micro-batch passes through all of
        them (under ZB-H1 its weight passes may overlap other stages: not counted); replicas
        only add their allreduce, ZeRO-1 its update. 0 for one rank's plain fit, and where the
        costs cannot price the layout (the estimate says why)."""
        p, m = candidate.partitions, candidate.microbatches
        if candidate.world == 1:
            return 0.0
        try:
            costs = self._costs(candidate)
        except ValueError:
            return 0.0
        batch = self.global_batch / (candidate.replicas * m)
        if p == 1 and costs.fused is not None:  # the engine's one-call step
            return m * costs.fused.at(batch)
        key = (_recomputes(candidate), candidate.tensor)
        whole = self._whole[key].at(batch)
        through = whole
        if candidate.schedule == "zero_bubble":
            through -= self._weight[key].at(batch)
        return max(through, m * whole / p)

    def _costs(self, candidate: Candidate) -> ModelCosts:
        """The costs one rank of `candidate` pays per layer, recomputing or tensor-split
        (priced once each; a ValueError, if they cannot be, once too)."""
        key = (_recomputes(candidate), candidate.tensor)
        if key not in self._priced:
            try:
                costs = tensor_costs(
                    self._layer_costs(key[0]),
                    candidate.tensor,
                    self.network,
                    self._tensor_crosses_nodes(candidate.tensor),
                )
                self._whole[key] = _whole(costs)
                self._weight[key] = _weight(costs)
            except ValueError as error:
                costs = error
            self._priced[key] = costs
        if isinstance(self._priced[key], ValueError):
            raise self._priced[key]
        return self._priced[key]

    def _layer_costs(self, recompute: bool) -> ModelCosts:
        """The measured costs, or their recomputing form (made once)."""
        if recompute not in self._recomputed:
            self._recomputed[recompute] = _recomputing(self.costs) if recompute else self.costs
        return self._recomputed[recompute]

    def _tensor_crosses_nodes(self, tensor: int) -> bool:
        """Whether a group of `tensor` neighbouring ranks spans two nodes."""
        return self.ranks_per_node is not None and self.ranks_per_node % tensor != 0

    def _prediction(self, candidate: Candidate):
        c = candidate  # frozen: it keys its prediction by every field of the layout
        if c not in self._predictions:
            per_node = self.ranks_per_node and max(1, self.ranks_per_node // c.tensor)
            layout = Layout(
                c.partitions, c.replicas, c.microbatches, c.schedule, per_node, c.virtual_stages
            )
            self._predictions[c] = predict(
                self._costs(c),
                self.network,
                layout,
                self.global_batch,
                self.machine,
                shard_optimizer=c.shard_optimizer,
                shard_gradients=c.shard_gradients,
                shard_weights=c.shard_weights,
            )
        return self._predictions[c]


def _recomputes(candidate: Candidate) -> bool:
    """Whether the layout's stages run their forward again in the backward: `recompute`, or
    ZeRO-3, whose segments gather their weights again to recompute."""
    return candidate.recompute or candidate.shard_weights


def _whole(costs: ModelCosts) -> Affine:
    """Every layer's forward plus backward, summed."""
    return Affine(
        sum(layer.forward.fixed + layer.backward.fixed for layer in costs.layers),
        sum(layer.forward.per_sample + layer.backward.per_sample for layer in costs.layers),
    )


def _weight(costs: ModelCosts) -> Affine:
    """Every weight pass (`StageCost.weight_backward`: half a weighted layer's backward)."""
    halves = [layer.backward.scaled(0.5) for layer in costs.layers if layer.variables]
    return sum(halves, Affine())


def _weight(costs: ModelCosts) -> Affine:
    """Every weight pass (`StageCost.weight_backward`: half a weighted layer's backward)."""
    halves = [layer.backward.scaled(0.5) for layer in costs.layers if layer.variables]
    return sum(halves, Affine())


def _recomputing(costs: ModelCosts) -> ModelCosts:
    """`costs` with each layer's forward run again in its backward, as `recompute` does."""

    def again(layer):
        backward = Affine(
            layer.backward.fixed + layer.forward.fixed,
            layer.backward.per_sample + layer.forward.per_sample,
        )
        return replace(layer, backward=backward)

    return replace(costs, layers=[again(layer) for layer in costs.layers])
