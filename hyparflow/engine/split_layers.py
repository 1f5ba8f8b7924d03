"""The layers as one rank runs them: its tensor shards, its expert shards, and keras_hub's
mixture blocks dispatched sparsely, made together and entered as one context."""

from __future__ import annotations

import contextlib

from hyparflow.checkpoint.state import Piece
from hyparflow.comm.in_graph import allreduce
from hyparflow.engine.random_slices import feature_slice
from hyparflow.moe import ExpertShards, SparseDispatch, expert_groups
from hyparflow.tensor.shards import TensorShards


class SplitLayers:
    """`tensor`: this rank's `TensorShards` of its stage's split layers (None without tensor
    parallelism, docs/tensor.md); `experts`: its `ExpertShards` of the mixture blocks in
    `graphs` (None unless `strategy.experts` > 1); `dispatch`: the `SparseDispatch` of the
    model's mixture blocks, their routing counts summed over the stage's replicas in the step
    and, with `experts`, tokens exchanged in the expert group (docs/moe.md)."""

    def __init__(self, model, strategy, topology, graphs: list, tensor_layout=None):
        self.tensor = None
        if topology.num_shards > 1:
            self.tensor = TensorShards(tensor_layout, topology.tensor_comm, feature_slice)
        self.experts = None
        if strategy.experts > 1:
            groups = expert_groups(topology.stage_comm, strategy.experts)
            self.experts = ExpertShards(graphs, *groups)
        replicas = topology.stage_comm if topology.num_replicas > 1 else None
        replica_sum = replicas and (lambda vector: allreduce(replicas, vector, "experts"))
        self.dispatch = SparseDispatch(
            model if strategy.sparse_experts else None, replica_sum,
            self.experts and self.experts.group,
        )  # fmt: skip

    def _shards(self) -> list:
        return [s for s in (self.tensor, self.experts) if s is not None]

    def active(self) -> contextlib.ExitStack:
        """Layers hold this rank's shards and run their split and sparse calls (re-entrant)."""
        stack = contextlib.ExitStack()
        for shards in self._shards():
            stack.enter_context(shards.active())
        stack.enter_context(self.dispatch)
        return stack

    def load(self) -> None:
        """Cut the model's current whole weights into this rank's shards."""
        for shards in self._shards():
            shards.load()

    def store(self, guard) -> None:
        """Put every rank's shards together into the model's whole weights (collective)."""
        for shards in self._shards():
            shards.store(guard)

    def pieces(self) -> tuple[dict, dict]:
        """(path -> `Piece` of this rank, path -> its shard variable) of every variable split
        over tensor ranks or an expert group, as checkpoints key them."""
        split, variables = {}, {}
        for shards in self._shards():
            parts, index = shards.parts, shards.index
            for s in shards.shards:
                split[s.whole.path] = Piece(index, parts, s.axis)
                variables[s.whole.path] = s.shard
        return split, variables

    def free(self) -> None:
        if self.experts is not None:
            self.experts.free()
