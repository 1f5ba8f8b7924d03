"""Summing a step's gradients over the stages that share a layer and over the stage's replicas."""

from __future__ import annotations

import tensorflow as tf

from hyparflow import _keras
from hyparflow.comm.allreduce import GradientReducer
from hyparflow.comm.backends import make_reducer
from hyparflow.engine.gradients import sparse as row_sparse


class Gradients:
    """A step's reduced gradients: a list in variable order, or the dense ones as one flat
    tensor (`layout`'s) beside the embedding tables' row slices."""

    def __init__(self, merge, grads=None, flat=None, tables=(), layout=None):
        self._merge = merge
        self.grads, self.flat, self.tables, self.layout = grads, flat, list(tables), layout

    def as_list(self) -> list:
        """Every gradient in variable order (views of the flat tensor where there is one)."""
        if self.grads is None:
            self.grads = self._merge(self.layout.unflatten_fn(self.flat), self.tables)
        return self.grads

    def give_up(self) -> list:
        """The gradients, for an update that lets each go once applied: `[flat, *tables]`
        where they are flat (`layout`), else in variable order. This object holds none after,
        so the list returned is their only reference."""
        handed = self.grads if self.layout is None else [self.flat, *self.tables]
        self.grads, self.flat, self.tables = None, None, []
        return handed


class SharedAcrossStages:
    """The variables the stages of several pipeline ranks use, in one order agreed by every
    rank, and where this rank's variables sit in it (`positions`, None for those it does not
    use). Stages of one rank (interleaved) that share a variable sum its gradient locally."""

    def __init__(self, variables: list, tables: list[bool], positions: list):
        self.variables, self.tables, self.positions = variables, tables, positions

    @classmethod
    def find(
        cls, plan, model, stage_variables: list, row_kinds=row_sparse.UNPROBED
    ) -> SharedAcrossStages | None:
        """None when no variable is shared (or the model is not partitioned). Stages look a
        shared table up in their own calls: their rows concatenate, whatever `row_kinds` says."""
        # By variable, not layer name: a layer may be called in one stage directly and in
        # another inside a composite layer (keras_hub's tied token embedding in OPT).
        if plan is None:
            return None
        users: dict = {}
        for stage in plan.stages:
            for v in stage.model.trainable_variables:
                users.setdefault(id(v), set()).add(plan.holder(stage.index))
        shared = [v for v in model.trainable_variables if len(users.get(id(v), ())) > 1]
        if not shared:
            return None
        mine = {id(v): i for i, v in enumerate(stage_variables)}
        table_positions = row_sparse.row_sparse_positions(
            shared, _keras.all_layers(model), row_kinds
        )
        tables = [j in table_positions for j in range(len(shared))]
        return cls(shared, tables, [mine.get(id(v)) for v in shared])

    def dense_specs(self) -> list:
        return [
            (tuple(v.shape), v.dtype)
            for v, t in zip(self.variables, self.tables, strict=True)
            if not t
        ]

    def sum(self, grads: list, reducer, comm) -> list:
        """Sum the shared gradients over the pipeline `comm` (`reducer` for the dense ones,
        tables' row slices gathered as `reduce_rows` does across replicas)."""
        dense, tables = [], []
        for i, v, table in zip(self.positions, self.variables, self.tables, strict=True):
            if table:
                tables.append(grads[i] if i is not None else row_sparse.empty_rows(v))
            else:
                dense.append(grads[i] if i is not None else tf.zeros(v.shape, v.dtype))
        dense = iter(reducer.reduce(dense) if dense else [])
        tables = iter(row_sparse.reduce_rows(comm, tables))
        grads = list(grads)
        for i, table in zip(self.positions, self.tables, strict=True):
            total = next(tables) if table else tf.convert_to_tensor(next(dense))
            if i is not None:
                grads[i] = total
        return grads


class Overlap:
    """Which gradients are final after which segment, and the reduction order that follows."""

    def __init__(self, order: list[int], ready_at: dict):
        self.order = order  # stage variable indices, in the order they become final
        self.ready_at = ready_at  # segment -> [(position in order, variable)]

    @classmethod
    def plan(cls, sub_plan, variables: list) -> Overlap:
        first_segment = {}
        for j, segment in enumerate(sub_plan.stages):
            for v in segment.model.trainable_variables:
                first_segment.setdefault(id(v), j)  # backward reaches lower segments later
        ready = [first_segment.get(id(v), -1) for v in variables]
        order = sorted(range(len(variables)), key=lambda i: (-ready[i], i))
        ready_at: dict = {}
        for position, i in enumerate(order):
            if ready[i] >= 0:
                ready_at.setdefault(ready[i], []).append((position, variables[i]))
        return cls(order, ready_at)


class GradientSync:
    """Every way a stage's summed gradients become the whole job's, behind `reduce()`.

    - flat (`runner.layout`): one `reduce_flat` of the flat tensor across replicas;
    - per variable: the pipeline sum of layers shared by stages (`shared`), then the replica
      reduction in fused buckets (`backend` "mpi") or Horovod's grouped allreduce;
    - overlapped (`overlap`, with a `SegmentedRunner`): each segment's final gradients start
      reducing during the step's last backward (`on_segment_done`), the rest in `reduce`;
    - embedding tables: row slices gathered from every replica, as one process has them;
    - expert shards (`experts`, an `ExpertShards`; per variable only): summed over the ranks
      holding the same experts (`experts.across`), not over every replica.

    Reducers are built here, collectively over the world.
    """

    def __init__(
        self,
        topology,
        runner,
        variables,
        dense,
        sparse,
        *,
        backend,
        shared,
        overlap,
        experts=None,
        row_kinds=row_sparse.UNPROBED,
    ):
        self.topology = topology
        self.runner = runner
        self.variables, self.sparse = variables, sparse
        # per table: whether its rows come once per batch (replicas add them row by row)
        self.tables_per_batch = row_sparse.per_batch_flags(variables, sparse, row_kinds)
        self.shared = shared  # SharedAcrossStages or None
        self.overlap = overlap  # Overlap or None
        self._started: set[int] = set()  # this step's positions handed to the reducer early
        # gradients handed to the reducer during a backward, over all steps (None: no overlap)
        self.early_starts = None if overlap is None else 0
        held = {id(v) for v in experts.variables} if experts is not None else set()
        self.experts = [i for i in dense if id(variables[i]) in held]
        self.expert_reducer = None
        if self.experts and experts.across.Get_size() > 1:
            specs = [variables[i] for i in self.experts]
            self.expert_reducer = GradientReducer(experts.across, specs=specs, op="sum")
        self.dense = dense
        dense = [i for i in dense if id(variables[i]) not in held]
        if overlap is not None:
            self.replica_reducer = GradientReducer(
                topology.stage_comm,
                specs=[variables[i] for i in overlap.order],
                op="sum",
                background=True,
            )
        else:
            dense_variables = [variables[i] for i in dense]
            self.replica_reducer = make_reducer(backend, topology, dense_variables, op="sum")
        self.shared_reducer = (
            GradientReducer(topology.pipeline_comm, specs=shared.dense_specs(), op="sum")
            if shared is not None and shared.dense_specs()
            else None
        )

    @property
    def on_segment_done(self):
        """The hook the last backward calls after each segment (None without overlap)."""
        return None if self.overlap is None else self._on_segment_done

    def merge(self, dense: list, tables: list) -> list:
        """One gradient list in variable order from the dense ones and the tables'."""
        return row_sparse.in_order(len(self.variables), self.dense, dense, self.sparse, tables)

    def reduce(self) -> Gradients:
        """Take the step's gradients from the runner and sum them over the pipeline's shared
        layers and the stage's replicas (collective)."""
        runner = self.runner
        layout = runner.layout
        if layout is not None:
            flat = runner.take_flat_gradients()
            if self.topology.num_replicas > 1:  # (Horovod's reducer has no flat call)
                flat = self.replica_reducer.reduce_flat(flat)
            tables = self._reduce_tables(runner.take_sparse_gradients())
            return Gradients(self.merge, flat=flat, tables=tables, layout=layout)
        if self.overlap is not None:
            return Gradients(self.merge, grads=self._finish_overlapped_reduction())
        grads = runner.take_gradients()
        if self.shared is not None:
            grads = self.shared.sum(grads, self.shared_reducer, self.topology.pipeline_comm)
        return Gradients(self.merge, grads=self._reduce_over_replicas(grads))

    def _reduce_over_replicas(self, grads: list) -> list:
        """Sum every gradient over this stage's replicas (tables' row slices gathered), an
        expert shard's over the replicas holding the same experts."""
        experts = set(self.experts)
        replicated = [i for i in self.dense if i not in experts]
        summed = dict(
            zip(
                replicated, self.replica_reducer.reduce([grads[i] for i in replicated]), strict=True
            )
        )
        shards = [grads[i] for i in self.experts]
        if self.expert_reducer is not None:
            shards = self.expert_reducer.reduce(shards)
        summed.update(zip(self.experts, shards, strict=True))
        return self.merge(
            [tf.convert_to_tensor(summed[i]) for i in self.dense],
            self._reduce_tables([grads[i] for i in self.sparse]),
        )

    def _reduce_tables(self, tables: list) -> list:
        """The embedding tables' gradients over this stage's replicas, as one process has them."""
        if not tables or self.topology.num_replicas == 1:
            return tables
        return row_sparse.reduce_rows(self.topology.stage_comm, tables, self.tables_per_batch)

    def _on_segment_done(self, j: int) -> None:
        """Last micro-batch's backward finished segment j: reduce what is now final."""
        self.runner.collect(j)
        for position, variable in self.overlap.ready_at.get(j, []):
            self.replica_reducer.start(position, self.runner.total(variable))
            self._started.add(position)
            self.early_starts += 1

    def _finish_overlapped_reduction(self) -> list:
        """Start whatever is left (nothing ran, or unused variables), wait, restore order."""
        overlap = self.overlap
        for position, i in enumerate(overlap.order):
            if position not in self._started:
                self.replica_reducer.start(position, self.runner.total(self.variables[i]))
        reduced = self.replica_reducer.finish()
        self._started = set()
        self.runner.reset()
        grads = [None] * len(self.variables)
        for position, i in enumerate(overlap.order):
            grads[i] = tf.convert_to_tensor(reduced[position])
        return grads
