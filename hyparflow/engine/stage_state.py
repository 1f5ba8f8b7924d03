"""This rank's stage as checkpoints see it: step, seed, owned weights, layers, metric sums."""

from __future__ import annotations

import numpy as np

from hyparflow import _keras
from hyparflow.engine.weights import weight_owners


class TrainingState:
    """The engine's `hyparflow.checkpoint.stage.StageState` for one (stage, replica) rank.

    `plan` is None for an unpartitioned model (the first stage then owns every weight and runs
    every layer); `guard(operation)` watches blocking MPI waits (the trainer's watchdog).
    """

    def __init__(
        self,
        model,
        topology,
        plan,
        variables: list,
        guard,
        split=None,
        shard_variables=None,
        experts: int = 1,
        optimizer_shard=None,
    ):
        self.model = model
        self.variables = variables
        self.world = topology.world
        self.stage, self.replica = topology.stage, topology.replica
        self.num_stages, self.num_replicas = topology.num_stages, topology.num_replicas
        self.is_first, self.is_last = topology.is_first_stage, topology.is_last_stage
        self.step = 0  # optimizer steps taken through this trainer
        self.seed = 0  # the shared shuffle seed of the current fit (checkpoints record it)
        self.pending_metric_states: list = []
        self.shard, self.num_shards = topology.shard, topology.num_shards
        self.split = dict(split or {})  # path -> Piece of each variable this rank holds a part of
        self.shard_variables = dict(
            shard_variables or {}
        )  # path -> this rank's shard variable of each of them
        # replica 0 writes its tensor pieces, each position of the first expert group (its first
        # tensor rank) its experts
        first_group = topology.replica < experts and topology.shard == 0
        self.writes_pieces = topology.replica == 0 or first_group
        # ZeRO-1's `SliceCheckpoint`: each replica saves its slices of the optimizer state
        self.optimizer_shard = optimizer_shard
        self._stage_comm = topology.stage_comm
        self._plan = plan
        self._guard = guard
        self._layer_ids = None
        if plan is not None:  # the layers of every stage this rank runs
            graphs = [stage.model for stage in plan.stages_on(self.stage)]
            self._layer_ids = {id(x) for graph in graphs for x in _keras.all_layers(graph)}

    def guard(self, operation: str):
        return self._guard(operation)

    def owned_weight_indices(self) -> list[int]:
        if self._plan is None:
            return list(range(len(self.model.weights))) if self.is_first else []
        owners = weight_owners(self._plan, self.model)
        return [i for i, owner in enumerate(owners) if owner == self.stage]

    def runs_layer(self, layer) -> bool:
        if self._plan is None:
            return self.is_first
        return id(layer) in self._layer_ids

    def summed_metric_states(self) -> list:
        if not self.is_last:
            return []
        local = [np.asarray(v.numpy()) for v in self.model.metrics_variables]
        with self._guard("sum metric states over replicas"):
            return [self._stage_comm.allreduce(a) for a in local]

    def restore_metric_states(self) -> None:
        """Add the metric sums of a resumed epoch's batches before its checkpoint (once, on
        the last stage's replica 0), after the resumed epoch's first step: the compiled
        metrics (accuracy) exist in `model.metrics_variables` only once a step has built them.
        Their states are sums, as the checkpoint's sum over replicas already takes them."""
        states, self.pending_metric_states = self.pending_metric_states, []
        if self.is_last and self.replica == 0 and states:
            for variable, value in zip(self.model.metrics_variables, states, strict=True):
                variable.assign_add(value)
