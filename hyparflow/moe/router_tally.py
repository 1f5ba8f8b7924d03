"""Router load-balancing losses of a step cut into micro-batches, exact in GPipe's order.

The loss of the global batch is `L = sum_e c_e * sum_pieces S_e` (`router_loss.py`): `S_e` a
piece's sum of router probabilities for expert `e`, `c_e = coef * E * f_e / N` known only from
the routing counts of every piece (`f_e` the share of picks, `N` the tokens). A micro-batch's
forward cannot know them, so each mixture block records its counts and sums there instead of
adding a loss (`record`, while tracing), the stage returns them beside its outputs, and once
every micro-batch of the step has run forward (GPipe: every forward before any backward) the
counts summed over the micro-batches and the replicas give `c`: the output gradient each
micro-batch's backward hands its sums, and the loss's value (docs/notes/moe_design.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

_ROUTED_SLOTS = 2  # after a block's picks per expert: its tokens counted, its rows


@dataclass(frozen=True)
class RoutedBlock:
    """What a block's coefficients are made of: its experts, picks per token, loss weight."""

    experts: int
    top_k: int
    weight: float


class RouterTally:
    """One stage's router losses over a step's micro-batches.

    `sum_over_replicas(vector)` (host side, collective over the stage's replicas; None with
    one replica) adds the counts of the other replicas' micro-batches.

    For example, a stage's step of two micro-batches:
        counts, sums = tally.collect()  # in the forward's trace, after the blocks' calls
        tally.forwarded(0, counts0, sums0); tally.forwarded(1, counts1, sums1)
        tally.output_gradient(1)  # the gradient of micro-batch 1's sums, times its scale
        tally.take_parts()  # [(rows, loss value)] per micro-batch, as the engine sums them
    """

    def __init__(self, sum_over_replicas: Callable | None = None):
        self.sum_over_replicas = sum_over_replicas
        self.blocks: list[RoutedBlock] = []  # in the order a forward records them
        self._traced: list = []  # (block, counts, sums) recorded in the trace under way
        self._counts: dict[int, np.ndarray] = {}  # micro-batch -> its counts
        self._sums: dict[int, np.ndarray] = {}  # micro-batch -> its probability sums
        self._coefficients = None  # this step's c, once every micro-batch has run forward
        self._rows = 0.0  # the global batch's rows

    # --- while tracing a forward ------------------------------------------------------------
    def record(self, block: RoutedBlock, picked, tokens, rows, probability_sums) -> None:
        """Note a block's routing of this micro-batch (`router_loss.routing_sums`, its rows)."""
        counts = tf.concat([picked, tf.stack([tokens, tf.cast(rows, tf.float32)])], axis=0)
        self._traced.append((block, counts, probability_sums))

    def collect(self):
        """(counts, probability sums) of the blocks recorded since the last call, each one
        vector in their order; None when no block recorded."""
        traced, self._traced = self._traced, []
        if not traced:
            return None
        self.blocks = [block for block, _, _ in traced]
        return tf.concat([c for _, c, _ in traced], 0), tf.concat([s for _, _, s in traced], 0)

    # --- during the step ---------------------------------------------------------------------
    def forwarded(self, microbatch: int, counts, probability_sums) -> None:
        """Keep `microbatch`'s counts and sums (a forward after the step's backwards began
        starts a new step)."""
        if self._coefficients is not None:
            self._reset()
        self._counts[microbatch] = np.asarray(counts, np.float64)
        self._sums[microbatch] = np.asarray(probability_sums, np.float64)

    @property
    def routed(self):
        """The step's micro-batches whose forward recorded routing."""
        return self._counts.keys()

    def output_gradient(self, microbatch: int) -> tf.Tensor:
        """The gradient of `microbatch`'s sums times its scale (its share of the global batch
        times the loss scale, as the stage returns them): `c` over its share."""
        if self._coefficients is None:
            self._coefficients = self._coefficients_of_step()
        return tf.constant(self._coefficients / self._share(microbatch), tf.float32)

    def take_parts(self) -> list:
        """(rows, loss value) of each micro-batch of the step, weighted as the engine weights
        added losses (rows / global rows); the tally then starts a new step."""
        if self._coefficients is None and self._counts:  # no backward ran (none needed)
            self._coefficients = self._coefficients_of_step()
        parts = [
            (self._local_rows(k), float(self._coefficients @ sums) / self._share(k))
            for k, sums in self._sums.items()
        ]
        self._reset()
        return parts

    def _reset(self) -> None:
        self._counts, self._sums, self._coefficients = {}, {}, None

    def _coefficients_of_step(self) -> np.ndarray:
        local = np.sum(list(self._counts.values()), axis=0)
        total = local if self.sum_over_replicas is None else self.sum_over_replicas(local)
        coefficients, offset = [], 0
        for block in self.blocks:
            picked = total[offset : offset + block.experts]
            tokens = max(total[offset + block.experts], 1e-9)
            self._rows = total[offset + block.experts + 1]
            dispatched = picked / (block.top_k * tokens)  # f_e
            coefficients.append(block.weight * block.experts * dispatched / tokens)
            offset += block.experts + _ROUTED_SLOTS
        return np.concatenate(coefficients)

    def _local_rows(self, microbatch: int) -> float:
        return float(self._counts[microbatch][self.blocks[0].experts + 1])

    def _share(self, microbatch: int) -> float:
        return self._local_rows(microbatch) / self._rows
