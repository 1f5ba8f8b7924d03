"""The layers as one rank runs them: its tensor shards, its expert shards, keras_hub's mixture
blocks dispatched sparsely and `hf.global_mean`'s replicas, made together and entered as one
context."""

from __future__ import annotations

import contextlib

import numpy as np

from hyparflow import deferred
from hyparflow.checkpoint.state import Piece
from hyparflow.comm.agree import same_ranks
from hyparflow.comm.in_graph import allreduce
from hyparflow.engine.keras_semantics import global_batch
from hyparflow.engine.keras_semantics.global_batch import BatchGroup, batch_group
from hyparflow.engine.keras_semantics.random_slices import feature_slice
from hyparflow.moe import (
    ExpertShards,
    RouterTally,
    SparseDispatch,
    expert_groups,
    expert_parallel,
    router_loss_weight,
    sparse_blocks,
)
from hyparflow.tensor import collectives
from hyparflow.tensor.shards import TensorShards


class ShardedLayers:
    """`tensor`: this rank's `TensorShards` of its stage's split layers (None without tensor
    parallelism, docs/tensor.md); `experts`: its `ExpertShards` of the mixture blocks in
    `graphs` (None unless `strategy.experts` > 1); `dispatch`: the `SparseDispatch` of the
    model's mixture blocks, their routing counts summed over the stage's replicas in the step
    and, with `experts`, tokens exchanged in the expert group (docs/moe.md); `batch`: the
    replicas `hf.global_mean` means over (engine/keras_semantics/global_batch.py); `tally`: the
    `RouterTally` of a step of several micro-batches whose mixture blocks add router losses (else
    None), its counts summed over the replicas under `guard`. `synchronized`: whether some
    BatchNormalization sums its moments over the replicas (`sync_batchnorm.py`). Their in-graph
    collectives count in `traffic`, the trainer's `TrafficLog`."""

    def __init__(
        self,
        model,
        strategy,
        topology,
        graphs,
        tensor_layout=None,
        guard=None,
        synchronized=False,
        *,
        traffic,
    ):
        guard = guard or (lambda operation: contextlib.nullcontext())
        self.tensor = None
        if topology.num_shards > 1:
            self.tensor = TensorShards(
                tensor_layout, topology.tensor_comm, traffic.of(collectives.TAG), feature_slice
            )
        self.experts = None
        if strategy.experts > 1:
            groups = expert_groups(topology.stage_comm, strategy.experts)
            self.experts = ExpertShards(graphs, *groups)
        replicas = topology.stage_comm if topology.num_replicas > 1 else None
        # `hf.global_mean`'s replicas, and the layers that take it (their added losses exact)
        self.batch = BatchGroup(
            replicas, strategy.microbatches, traffic=traffic.of(global_batch.TAG)
        )
        self.synchronized = synchronized
        routing = traffic.of(expert_parallel.TAG)  # the routing counts' sums
        replica_sum = replicas and (lambda vector: allreduce(replicas, vector, routing))
        self.tally = _router_tally(model, strategy, replicas, guard)
        self.dispatch = SparseDispatch(
            model if strategy.sparse_experts else None,
            replica_sum,
            self.experts and self.experts.group,
            self.tally,
            strategy.capacity_factor,
            traffic=traffic,
        )

    def sum_over_replicas(self, training: bool) -> bool:
        """Whether the layers sum over the stage's replicas inside a forward (expert exchanges,
        router losses and synchronised BatchNormalization in training, `hf.global_mean` once
        traced): then every replica must run each forward."""
        if self.batch.comm is None:
            return False
        weighted = any(router_loss_weight(block) for block in self.dispatch.blocks)
        router_losses = training and self.dispatch.global_sum is not None and weighted
        synchronized = training and self.synchronized
        return self.experts is not None or router_losses or synchronized or bool(self.batch.users)

    def refuse_empty_replicas(self, rows: int, replicas: int, training: bool) -> None:
        """Raise, alike on every rank, when a batch of `rows` leaves one of `replicas` without
        rows while the layers sum over them inside the step: it would never join their sums,
        and the others would wait for it."""
        if rows < replicas and self.sum_over_replicas(training):
            raise ValueError(
                f"A batch of {rows} sample(s) leaves some of the {replicas} replicas without "
                "rows, and this model's layers sum over the replicas inside the step (mixture "
                "routing, expert exchanges, synchronised BatchNormalization, hf.global_mean); "
                "give every batch at least "
                f"{replicas} samples (e.g. drop_remainder=True, or another batch_size)."
            )

    def _shards(self) -> list:
        return [s for s in (self.tensor, self.experts) if s is not None]

    def active(self) -> contextlib.ExitStack:
        """Layers hold this rank's shards and run their split and sparse calls, and
        `hf.global_mean` means over the stage's replicas (re-entrant)."""
        stack = contextlib.ExitStack()
        for shards in self._shards():
            stack.enter_context(shards.active())
        stack.enter_context(self.dispatch)
        stack.enter_context(batch_group(self.batch))
        return stack

    def load(self) -> None:
        """Cut the model's current whole weights into this rank's shards."""
        for shards in self._shards():
            shards.load()

    def store(self, guard) -> None:
        """Put every rank's shards together into the model's whole weights (collective)."""
        for shards in self._shards():
            shards.store(guard)

    def take_over(self) -> None:
        """The split whole variables get backings that `release` can empty and `store` fill
        again (`Shard.take_over`); the caller drops Keras's steps traced over the old ones."""
        for shard in self._each_shard():
            shard.take_over()

    def release(self) -> None:
        """Take the whole weights' values into the shards, then let the wholes go until
        `store`: while hf.fit trains, the shards are the weights (nothing where let go)."""
        for shard in self._each_shard():
            shard.release()

    def any_released(self) -> bool:
        """Whether some whole variable holds nothing now (released, not yet stored)."""
        return any(deferred.is_let_go(shard.whole) for shard in self._each_shard())

    def shard_groups(self) -> dict:
        """Kind ("tensor", "experts") -> (the communicator its shards are split over, its
        `Shard`s), for the kinds of shards this rank holds."""
        groups = {}
        if self.tensor is not None:
            groups["tensor"] = (self.tensor.comm, self.tensor.shards)
        if self.experts is not None:
            groups["experts"] = (self.experts.group, self.experts.shards)
        return groups

    def _each_shard(self) -> list:
        return [shard for shards in self._shards() for shard in shards.shards]

    def pieces(self) -> tuple[dict, dict]:
        """(path -> `Piece` of this rank, path -> its shard variable) of every variable split
        over tensor ranks or an expert group, as checkpoints key them."""
        split, variables = {}, {}
        for shards, over in ((self.tensor, "tensor"), (self.experts, "experts")):
            if shards is None:
                continue
            for s in shards.shards:
                split[s.whole.path] = Piece(shards.index, shards.parts, s.axis, over)
                variables[s.whole.path] = s.shard
        return split, variables

    def expert_split(self) -> tuple:
        """(this rank's expert shards, its expert group), or ((), None) without experts."""
        return (self.experts.variables, self.experts.group) if self.experts else ((), None)

    def take_router_losses(self) -> list:
        """The (rows, loss value) of each micro-batch's router losses in the last step (none
        without a tally), as the engine sums added losses."""
        return [] if self.tally is None else self.tally.take_parts()

    def free(self) -> None:
        if self.experts is not None:
            self.experts.free()


def _router_tally(model, strategy, replicas, guard):
    """A `RouterTally` when a step has several micro-batches and sparse mixture blocks add
    router losses, its counts summed over `replicas` (None: one) under `guard`."""
    weighted = strategy.sparse_experts and any(router_loss_weight(b) for b in sparse_blocks(model))
    if strategy.microbatches == 1 or not weighted:
        return None
    if replicas is None:
        return RouterTally()

    def replica_sum(vector):
        total = np.empty_like(vector)
        with guard("sum routing counts over replicas"):
            replicas.Allreduce(vector, total)
        return total

    return RouterTally(replica_sum)


def store_after_failure(clean, layers) -> None:
    """After a step failed on every rank: `layers.store` (a `ShardedLayers`; None where this
    rank holds none) over groups of the same ranks split out of `clean`, a duplicate of the
    fit's communicator that no failed step used (the shards' own may be left mid-collective),
    where some rank let its whole variables go and every rank holds its layers (a group with
    a member missing could not put its shards together). Collective over `clean`."""
    flags = clean.allgather((layers is not None, layers is not None and layers.any_released()))
    if not (all(has for has, _ in flags) and any(released for _, released in flags)):
        return
    groups = layers.shard_groups() if layers is not None else {}
    for kind in ("tensor", "experts"):
        comm, shards = groups.get(kind, (None, ()))
        group = same_ranks(clean, comm)
        if group is None:
            continue
        try:
            for shard in shards:
                shard.store(group, _unguarded, f"gather {kind} shards")
        finally:
            group.Free()


def _unguarded(operation: str):
    return contextlib.nullcontext()
