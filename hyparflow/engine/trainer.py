"""One rank's share of training: its stage of its replica's pipeline, step by step.

A step walks the stage's schedule (GPipe or 1F1B) over the micro-batches of its replica's
shard, then sums gradients across the stages that share a layer and across replicas, adds
weight regularization once, and applies the compiled optimizer to the stage's variables.
The loss of each micro-batch is its mean times its share of the global batch, so the summed
gradient is exactly the gradient of Keras's loss on the whole global batch.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
from keras import ops, tree
from keras.optimizers import LossScaleOptimizer

from hyparflow.comm.agree import AgreedError
from hyparflow.comm.allreduce import GradientReducer
from hyparflow.comm.backends import make_reducer
from hyparflow.comm.p2p import BACKWARD, FORWARD, PipeChannel
from hyparflow.comm.topology import Topology
from hyparflow.comm.watchdog import NoWatchdog, Watchdog
from hyparflow.data import GlobalBatch, piece_bounds
from hyparflow.engine import events
from hyparflow.engine import sparse as rows
from hyparflow.engine.added_losses import added_loss, warn_unless_batch_means
from hyparflow.engine.flat import FlatLayout
from hyparflow.engine.fused import FusedRunner
from hyparflow.engine.metrics import ReplicaMetrics
from hyparflow.engine.schedule import forward_only, make_schedule
from hyparflow.engine.segments import SegmentedRunner
from hyparflow.engine.stage import StageRunner


def model_input_list(model, x) -> list:
    """The user's `x` (array, list or dict) as a list in `model.inputs` order."""
    if isinstance(x, dict):
        names = [t._keras_history.operation.name for t in model.inputs]
        if set(names) <= set(x):
            return [x[name] for name in names]
        return tree.flatten(x)
    return list(x) if isinstance(x, (list, tuple)) else [x]


def pack_model_outputs(model, flat: list):
    """The last stage's flat outputs in the structure `model(x)` returns (tensor, list, dict)."""
    struct = getattr(model, "_outputs_struct", None)  # functional models
    if struct is None:
        functional = getattr(model, "_functional", None)  # Sequential wraps a functional model
        struct = getattr(functional, "_outputs_struct", None)
    if struct is None:
        return flat[0] if len(flat) == 1 else list(flat)
    return tree.pack_sequence_as(struct, flat)


def _as_tensors(structure):
    return tree.map_structure(lambda a: None if a is None else tf.convert_to_tensor(a), structure)


class Trainer:
    """Training, evaluation and prediction steps for this rank's (stage, replica).

    `plan` is None for data parallelism (the whole user model is the only stage, so any model
    works, subclassed ones included); otherwise the partitioner's `Plan`.
    """

    def __init__(
        self, model, strategy, comm, plan=None, watchdog_timeout: float = 0.0,
        comm_backend: str = "mpi",
    ):  # fmt: skip
        self.model = model
        self.strategy = strategy
        self.topology = Topology.create(comm, strategy.partitions, strategy.replicas)
        topo = self.topology
        self.step = 0  # optimizer steps taken through this trainer
        self.seed = 0  # the shared shuffle seed of the current fit (checkpoints record it)
        self.pending_metric_states: list = []
        self.check_numerics = False
        self.watchdog = NoWatchdog()
        self.use_watchdog(watchdog_timeout)
        self.plan = plan
        self.is_first = topo.is_first_stage
        self.is_last = topo.is_last_stage
        if plan is None:
            self.stage = None
            self.variables = list(model.trainable_variables)
            call = self._call_whole_model
            self.owned = list(self.variables)
        else:
            self.stage = plan.stages[topo.stage]
            self.variables = list(self.stage.model.trainable_variables)
            call = self._call_stage
            self.owned = _owned_variables(plan, topo.stage)
        graph = model if plan is None else self.stage.model
        layers = list(graph._flatten_layers())
        # Embedding tables: their gradients stay row slices, apart from the flat dense ones.
        self.sparse = rows.row_sparse_positions(self.variables, layers)
        self.dense = sorted(set(range(len(self.variables))) - set(self.sparse))
        dense_variables = [self.variables[i] for i in self.dense]
        self._shared = self._shared_variable_indices()
        self._loss_adders: set = set()  # layers calling add_loss, found while tracing
        added_losses = lambda: added_loss(layers, self._loss_adders)  # noqa: E731 - in traces
        self._added_parts: list = []  # this step's (micro-batch size, added loss)
        self._any_added_losses = None  # whether any stage's layers add losses (agreed once)
        relax_shapes = _has_varying_dimensions(model if plan is None else None, self.stage)
        train_scope = self._batchnorm_scope(layers)
        self._moving_statistics = _unsynchronized_moving_statistics(layers, strategy)
        layout = FlatLayout(dense_variables) if strategy.flat_gradients else None
        use_flat = layout is not None and layout.usable  # float32 variables, flat gradients wanted
        if plan is None:  # nothing lives between forward and backward: one compiled call
            self.runner = FusedRunner(
                call,
                self.variables,
                loss=self._loss,
                metrics=self._update_metrics,
                # Flat only where it pays: an MPI reduction across replicas.
                layout=layout
                if use_flat and comm_backend == "mpi" and topo.num_replicas > 1
                else None,
                sparse=self.sparse,
                added_losses=added_losses,
                relax_shapes=relax_shapes,
                train_scope=train_scope,
            )
        else:
            self.runner = StageRunner(
                call,
                self.variables,
                loss=self._loss if self.is_last else None,
                recompute=strategy.recompute,
                state_variables=self._forward_state() if strategy.recompute else (),
                metrics=self._update_metrics if self.is_last else None,
                input_grads=not self.is_first,
                sparse=self.sparse,
                added_losses=added_losses,
                relax_shapes=relax_shapes,
                train_scope=train_scope,
                **self._stage_gradient_form(layout, use_flat, plan, comm_backend),
            )
        self._update_metrics_fn = tf.function(self._update_metrics)
        # Compiled like Keras's own step: eager metric updates and results cost ~1 ms a step.
        self._loss_tracker_fn = tf.function(
            lambda value, count: model._loss_tracker.update_state(value, sample_weight=count)
        )
        self._replica_metrics = ReplicaMetrics(model, topo.stage_comm)
        self._regularized = [v for v in self.owned if getattr(v, "regularizer", None)]
        self._reg_fn = tf.function(self._regularization_and_grads)
        self._has_regularizers = bool(
            topo.pipeline_comm.allreduce(len(self._regularized) > 0, op=_mpi_op("LOR"))
        )
        # Keras clips by the norm of the whole model's gradient: stages must agree on it.
        self._clips_across_stages = plan is not None and bool(
            getattr(_inner(model.optimizer), "global_clipnorm", None)
        )
        self._overlap = None
        if (
            strategy.overlap_groups > 1
            and topo.num_replicas > 1
            and self._shared is None
            and comm_backend == "mpi"
            and not self.sparse  # segments keep gradients dense
        ):
            self._overlap = self._segment_stage(strategy.overlap_groups)
        if self._overlap is not None:
            self.replica_reducer = GradientReducer(
                topo.stage_comm,
                specs=[self.variables[i] for i in self._overlap.order],
                op="sum",
                background=True,
            )
        else:
            self.replica_reducer = make_reducer(comm_backend, topo, dense_variables, op="sum")
        self.shared_reducer = (
            GradientReducer(topo.pipeline_comm, specs=self._shared_specs(), op="sum")
            if self._shared is not None and self._shared_specs()
            else None
        )
        self._channels: dict[int, tuple] = {}
        self._schedules: dict[tuple, tuple] = {}  # (train, micro-batches) -> this stage's actions
        self._log_root = topo.grid.rank_of(topo.num_stages - 1, 0)
        self.attach_recorder(None)

    def _batchnorm_scope(self, layers):
        """The context that sums BatchNormalization statistics of `layers` across replicas
        (those that want the global batch's: `synchronized=True`, or all with the strategy's
        `sync_batchnorm`); None when there is nothing to sum."""
        from hyparflow.engine.sync_batchnorm import synchronized_batchnorm, synchronized_layers

        topo = self.topology
        synced = synchronized_layers(layers, self.strategy.sync_batchnorm)
        if not synced or topo.num_replicas == 1:
            return None
        return lambda: synchronized_batchnorm(topo.stage_comm, synced)

    def _average_moving_statistics(self) -> None:
        """Replicas that normalise their shards alone average their moving statistics after
        each step (for the mean, Keras's update on the global batch), so they never drift."""
        variables = self._moving_statistics
        if not variables or self.topology.num_replicas == 1:
            return
        flat = _packed(variables)
        with self.watchdog.guard("average moving statistics over replicas"):
            self.topology.stage_comm.Allreduce(_mpi_op("IN_PLACE"), flat)
        _assign_packed(variables, flat / self.topology.num_replicas)

    def _stage_gradient_form(self, layout, use_flat: bool, plan, comm_backend: str) -> dict:
        """A pipeline stage's `layout` and `flat_backward`: flat unless gradients must be a
        list (shared layers are summed per variable over the pipeline, Horovod's reducer
        takes a list). Flat per micro-batch only where it pays (many small variables);
        otherwise summed per variable and flattened once, when replicas reduce them."""
        replicas = self.topology.num_replicas
        shared = self._shared is not None
        if not use_flat or shared or (comm_backend != "mpi" and replicas > 1):
            return {"layout": None}
        if layout.flat_backward_pays:
            return {"layout": layout, "flat_backward": True}
        return {"layout": layout if replicas > 1 else None, "flat_backward": False}

    def _segment_stage(self, groups: int):
        """Run this stage as `groups` segments so reductions overlap the backward (None when
        the stage cannot be cut, e.g. a subclassed model or too few layers)."""
        from hyparflow.partitioner import partition

        graph = self.model if self.plan is None else self.stage.model
        for count in range(groups, 1, -1):
            try:
                sub = partition(graph, count, balance="params")
                break
            except ValueError:
                continue
        else:
            return None
        last = len(sub.stages) - 1
        runners = []
        for j, segment in enumerate(sub.stages):
            packs = j == last and self.is_last
            layers = list(segment.model._flatten_layers(include_self=False))

            def call(inputs, training, segment=segment, packs=packs):
                flat = segment.forward(inputs, training=training)
                return pack_model_outputs(self.model, flat) if packs else flat

            runners.append(
                StageRunner(
                    call,
                    segment.model.trainable_variables,
                    loss=self._loss if packs else None,
                    recompute=self.strategy.recompute,
                    state_variables=(
                        self._forward_state(segment.model) if self.strategy.recompute else ()
                    ),
                    input_grads=j > 0 or not self.is_first,
                    added_losses=lambda layers=layers: added_loss(layers, self._loss_adders),
                    relax_shapes=_has_varying_dimensions(None, segment),
                    train_scope=self._batchnorm_scope(layers),
                )
            )
        self.runner = SegmentedRunner(runners, self.variables)
        return _Overlap.plan(sub, self.variables)

    def _on_segment_done(self, j: int) -> None:
        """Last micro-batch's backward finished segment j: reduce what is now final."""
        self.runner.collect(j)
        for position, variable in self._overlap.ready_at.get(j, []):
            self.replica_reducer.start(position, self.runner.total(variable))
            self._overlap.started.add(position)
            self._overlap.early_starts += 1

    def _finish_overlapped_reduction(self) -> list:
        """Start whatever is left (nothing ran, or unused variables), wait, restore order."""
        overlap = self._overlap
        for position, i in enumerate(overlap.order):
            if position not in overlap.started:
                self.replica_reducer.start(position, self.runner.total(self.variables[i]))
        reduced = self.replica_reducer.finish()
        overlap.started = set()
        self.runner.reset()
        grads = [None] * len(self.variables)
        for position, i in enumerate(overlap.order):
            grads[i] = tf.convert_to_tensor(reduced[position])
        return grads

    def use_watchdog(self, timeout: float) -> None:
        """Guard blocking MPI waits with a `timeout`-second watchdog (0: none)."""
        if getattr(self.watchdog, "timeout", 0) == timeout:
            return
        self.watchdog.close()
        self.watchdog = Watchdog(self.topology.world, timeout) if timeout > 0 else NoWatchdog()

    def attach_recorder(self, recorder: events.Recorder | None) -> None:
        """Record timed spans of each training step into `recorder` (None: record nothing)."""
        self.recorder = recorder
        self._span = events.no_span if recorder is None else recorder.span
        self._step_span = events.no_step if recorder is None else recorder.step

    # --- what a stage computes ------------------------------------------------------------
    def _call_whole_model(self, x, training):
        return self.model(x, training=training)

    def _call_stage(self, inputs, training):
        outputs = self.stage.forward(inputs, training=training)
        flat = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        if self.is_last:
            return pack_model_outputs(self.model, flat)
        return flat

    def _loss(self, y, y_pred, sample_weight):
        return self.model._compile_loss(y, y_pred, sample_weight)

    def _update_metrics(self, y, y_pred, sample_weight):
        if self.model._compile_metrics is not None:
            self.model._compile_metrics.update_state(y, y_pred, sample_weight)

    def _regularization_and_grads(self):
        with tf.GradientTape() as tape:
            total = tf.add_n([tf.reduce_sum(v.regularizer(v)) for v in self._regularized])
        return total, tape.gradient(total, self._regularized)

    # --- sharing ---------------------------------------------------------------------------
    def _shared_variable_indices(self):
        """Indices (into this stage's variables) of variables that other stages also use."""
        # By variable, not layer name: a layer may be called in one stage directly and in
        # another inside a composite layer (keras_hub's tied token embedding in OPT).
        if self.plan is None:
            return None
        ids = {}
        for stage in self.plan.stages:
            for v in stage.model.trainable_variables:
                ids.setdefault(id(v), set()).add(stage.index)
        shared_all = [
            v for v in self.model.trainable_variables if len(ids.get(id(v), ())) > 1
        ]  # one agreed order on every stage
        if not shared_all:
            return None
        mine = {id(v): i for i, v in enumerate(self.variables)}
        self._shared_all = shared_all
        tables = rows.row_sparse_positions(shared_all, self.model._flatten_layers())
        self._shared_tables = [j in tables for j in range(len(shared_all))]
        return [mine.get(id(v)) for v in shared_all]

    def _shared_specs(self):
        return [
            (tuple(v.shape), v.dtype)
            for v, table in zip(self._shared_all, self._shared_tables)
            if not table
        ]

    def _sum_shared(self, grads: list) -> list:
        """Sum the gradients of layers used by several stages over the pipeline (tables' row
        slices gathered, as `reduce_rows` does across replicas)."""
        dense, tables = [], []
        for i, v, table in zip(self._shared, self._shared_all, self._shared_tables):
            if table:
                tables.append(grads[i] if i is not None else rows.empty_rows(v))
            else:
                dense.append(grads[i] if i is not None else tf.zeros(v.shape, v.dtype))
        dense = iter(self.shared_reducer.reduce(dense) if dense else [])
        tables = iter(rows.reduce_rows(self.topology.pipeline_comm, tables))
        grads = list(grads)
        for i, table in zip(self._shared, self._shared_tables):
            total = next(tables) if table else tf.convert_to_tensor(next(dense))
            if i is not None:
                grads[i] = total
        return grads

    # --- pipeline links ------------------------------------------------------------------
    def _links(self, max_microbatch: int, num_microbatches: int):
        """Channels to the previous and next stage sized for micro-batches of this size."""
        key = (max_microbatch, num_microbatches)
        if key not in self._channels:
            topo, stage = self.topology, self.stage

            def channel(peer, boundary):
                specs = [((max_microbatch, *t.shape), t.dtype) for t in boundary]
                floats = [s for s in specs if tf.as_dtype(s[1]).is_floating]  # carry gradients
                return PipeChannel(
                    topo.pipeline_comm, peer, specs, num_microbatches, backward_specs=floats
                )

            prev = None if self.is_first else channel(topo.prev_rank, stage.receives)
            nxt = None if self.is_last else channel(topo.next_rank, stage.sends)
            self._channels[key] = (prev, nxt)
        return self._channels[key]

    # --- the shard and its micro-batches -----------------------------------------------------
    def _microbatches(self, batch: GlobalBatch, microbatches: int):
        """This replica's shard of `batch` cut into micro-batches: [(x, y, sw, size, offset)],
        offset being where the micro-batch starts in the global batch."""
        topo = self.topology
        start, stop = piece_bounds(batch.size, topo.num_replicas, topo.replica)
        shard = stop - start
        if shard == 0:
            return []
        x, y, sw = batch.part(start, stop)
        count = min(microbatches, shard)
        pieces = []
        for k in range(count):
            a, b = piece_bounds(shard, count, k)
            cut = slice(a, b)
            pieces.append(
                (
                    _as_tensors(tree.map_structure(lambda t, c=cut: t[c], x))
                    if self.is_first
                    else None,
                    _as_tensors(tree.map_structure(lambda t, c=cut: t[c], y))
                    if self.is_last and y is not None
                    else None,
                    tf.convert_to_tensor(sw[cut]) if self.is_last and sw is not None else None,
                    b - a,
                    start + a,
                )
            )
        return pieces

    def _first_stage_inputs(self, x):
        whole = self.plan is None and self._overlap is None  # the user's model, any structure
        return x if whole else model_input_list(self.model, x)

    # --- steps ---------------------------------------------------------------------------
    def train_step(self, batch: GlobalBatch) -> None:
        """One optimizer step on one global batch (collective over every rank)."""
        pieces = self._microbatches(batch, self.strategy.microbatches)
        with self._step_span(batch.size, len(pieces)):
            losses = self._run_schedule(pieces, batch.size, train=True)
            guard = self.watchdog.guard("reduce gradients across stages and replicas")
            layout = self.runner.layout  # gradients are one flat tensor
            with self._span(events.ALLREDUCE), guard:
                if layout is not None:
                    flat = self.runner.take_flat_gradients()
                    if self.topology.num_replicas > 1:  # (Horovod's reducer has no flat call)
                        flat = self.replica_reducer.reduce_flat(flat)
                    tables = self._reduce_tables(self.runner.take_sparse_gradients())
                elif self._overlap is not None:
                    grads = self._finish_overlapped_reduction()
                else:
                    grads = self.runner.take_gradients()
                    if self._shared is not None:
                        grads = self._sum_shared(grads)
                    grads = self._reduce_over_replicas(grads)
            if self.check_numerics:
                if layout is not None:
                    grads = self._merge(layout.unflatten_fn(flat), tables)
                self._check_finite(losses, grads)
            with self._span(events.OPTIMIZER):
                if layout is None:
                    reg_value = self._apply(grads)
                elif self._clips_across_stages:  # the norm is summed between two calls
                    reg_value = self._apply(self._merge(layout.unflatten_fn(flat), tables))
                else:
                    reg_value = self._apply_flat(flat, tables)
        self._track_loss(losses, reg_value, self._added_total())
        self._average_moving_statistics()
        self.step += 1
        self.watchdog.step = self.step

    def _reduce_over_replicas(self, grads: list) -> list:
        """Sum every gradient over this stage's replicas (tables' row slices gathered)."""
        dense = self.replica_reducer.reduce([grads[i] for i in self.dense])
        return self._merge(
            [tf.convert_to_tensor(g) for g in dense],
            self._reduce_tables([grads[i] for i in self.sparse]),
        )

    def _reduce_tables(self, tables: list) -> list:
        """The embedding tables' gradients over this stage's replicas, as one process has them."""
        if not tables or self.topology.num_replicas == 1:
            return tables
        return rows.reduce_rows(self.topology.stage_comm, tables)

    def _merge(self, dense: list, tables: list) -> list:
        """One gradient list in variable order from the dense ones and the tables'."""
        return rows.in_order(len(self.variables), self.dense, dense, self.sparse, tables)

    def _check_finite(self, losses, grads) -> None:
        """Stop every rank together, naming step, rank and stage, on a NaN/Inf loss or gradient."""
        problem = None
        if any(not np.isfinite(float(loss)) for loss, _ in losses):
            problem = "loss"
        elif any(not _finite(g) for g in grads):
            bad = next(v for v, g in zip(self.variables, grads) if not _finite(g))
            problem = f"gradient of {bad.path}"
        topo = self.topology
        with self.watchdog.guard("agree on numerics"):
            reports = topo.world.allgather(
                None if problem is None else (topo.rank, topo.stage, problem)
            )
        found = [r for r in reports if r is not None]
        if found:
            rank, stage, what = found[0]
            raise AgreedError(
                FloatingPointError(
                    f"Non-finite {what} at step {self.step} on rank {rank} (pipeline stage "
                    f"{stage}); check the inputs for NaN/Inf, lower the learning rate, or use "
                    "gradient clipping."
                )
            )

    def _loss_scale(self) -> float:
        """Keras's dynamic loss scale under mixed_float16 (a LossScaleOptimizer), else 1."""
        optimizer = self.model.optimizer
        if isinstance(optimizer, LossScaleOptimizer):
            return float(optimizer.scale_loss(tf.constant(1.0)))
        return 1.0

    def _agree_finite_for_loss_scaling(self, grads: list) -> list:
        """Under loss scaling, every stage must skip an overflowing step together: if any rank
        saw Inf/NaN, all hand NaN gradients to their LossScaleOptimizer, which then skips the
        step and lowers the scale identically everywhere."""
        finite = all(_finite(g) for g in grads)
        with self.watchdog.guard("agree on finite scaled gradients"):
            finite = self.topology.world.allreduce(finite, op=_mpi_op("LAND"))
        if finite:
            return grads
        return [
            rows.like(g, tf.fill(tf.shape(rows.values_of(g)), tf.constant(float("nan"), g.dtype)))
            for g in grads
        ]

    def _apply(self, grads: list) -> float:
        """Add regularization gradients, step the optimizer; return the total regularization."""
        reg_value = 0.0
        if self._regularized:
            value, reg_grads = self._reg_fn()
            reg_value = float(value)
            # the stage gradients are of the scaled loss
            grads = self._add_regularization(grads, reg_grads, self._loss_scale())
        reg_value = self._sum_over_pipeline(reg_value)
        if isinstance(self.model.optimizer, LossScaleOptimizer):
            grads = self._agree_finite_for_loss_scaling(grads)
        norm = self._pipeline_norm(grads) if self._clips_across_stages else None
        if self.variables:  # a stage of only Add/Activation layers has nothing to update
            self._optimizer_step(grads, norm)
        return reg_value

    def _pipeline_norm(self, grads: list):
        """Keras's global gradient norm of the whole model (its `global_clipnorm`): squares of
        the variables each stage owns, summed over the pipeline (a shared layer counts once).
        Collective over the pipeline."""
        owned = {id(v) for v in self.owned}
        mine = [g for v, g in zip(self.variables, grads) if id(v) in owned]
        squares = 0.0
        if mine:
            fn = self.__dict__.setdefault(
                "_squares_fn", tf.function(_sum_of_squares, reduce_retracing=True)
            )
            squares = float(fn(mine, tf.constant(self._loss_scale(), tf.float32)))
        with self.watchdog.guard("sum the gradient norm over the pipeline"):
            total = self.topology.pipeline_comm.allreduce(squares)
        return tf.constant(math.sqrt(total), tf.float32)

    def _add_regularization(self, grads: list, reg_grads: list, loss_scale) -> list:
        """`grads` with the owned variables' regularization gradients (times the loss scale)."""
        grads = list(grads)
        position = {id(v): i for i, v in enumerate(self.variables)}
        for v, g in zip(self._regularized, reg_grads):
            i = position[id(v)]
            # dense, as one process's tape sums a table's row slices and a dense gradient
            grads[i] = tf.convert_to_tensor(grads[i]) + tf.cast(g, grads[i].dtype) * loss_scale
        return grads

    def _apply_flat(self, flat, tables: list) -> float:
        """`_apply` for reduced flat gradients, the update one compiled call: split into views,
        add regularization, step the optimizer. Pipeline stages agree on a loss-scale overflow
        first (an unpartitioned model's replicas hold the same sums: they see it alike)."""
        if self.plan is not None and isinstance(self.model.optimizer, LossScaleOptimizer):
            (flat, *tables) = self._agree_finite_for_loss_scaling([flat, *tables])
        update = self._compiled_update(self._flat_apply_body)
        value = update(flat, tables, tf.constant(self._loss_scale(), tf.float32))
        return self._sum_over_pipeline(float(value) if self._regularized else 0.0)

    def _sum_over_pipeline(self, reg_value: float) -> float:
        """This stage's regularization summed over its pipeline (as is, if no stage has any)."""
        if not self._has_regularizers:
            return reg_value
        with self.watchdog.guard("sum regularization over the pipeline"):
            return self.topology.pipeline_comm.allreduce(reg_value)

    def _flat_apply_body(self, flat, tables, loss_scale):
        grads = self._merge(self.runner.layout.unflatten(flat), tables)
        value = tf.constant(0.0)
        if self._regularized:
            value, reg_grads = self._regularization_and_grads()
            grads = self._add_regularization(grads, reg_grads, loss_scale)
        self.model.optimizer.apply(grads, self.variables)
        return value

    def _optimizer_step(self, grads: list, norm=None) -> None:
        """The optimizer's update as one compiled call, as Keras's own train step runs it;
        with `norm`, clipped by that global norm instead of the stage's own.

        Run eagerly, Keras's optimizers dispatch a few dozen ops per variable (Adam: ~60% of a
        small model's step); traced once, the update is one graph call.
        """
        if norm is None:
            self._compiled_update(self._optimizer_body)(list(grads))
        else:
            self._compiled_update(self._clipped_optimizer_body)(list(grads), norm)

    def _optimizer_body(self, grads):
        self.model.optimizer.apply(grads, self.variables)

    def _clipped_optimizer_body(self, grads, norm):
        """Keras's `clip_by_global_norm` with the whole model's norm, then the update."""
        optimizer = _inner(self.model.optimizer)
        clip = optimizer.global_clipnorm
        scale = clip * ops.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)  # NaN if not finite
        optimizer.global_clipnorm = None  # clipped here; the stage alone would see its own norm
        try:
            self.model.optimizer.apply([g * scale for g in grads], self.variables)
        finally:
            optimizer.global_clipnorm = clip

    def _compiled_update(self, body):
        """`body` as a `tf.function`, traced anew for each optimizer object (a recompiled model
        gets a new one), the optimizer built first: variables cannot be created in a trace."""
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.variables)
        compiled = self.__dict__.setdefault("_compiled_updates", {})
        name = body.__name__
        if name not in compiled or compiled[name][0] is not optimizer:
            # Tables' row counts vary by step: generalise shapes after a retrace, as Keras does.
            compiled[name] = (optimizer, tf.function(body, reduce_retracing=True))
        return compiled[name][1]

    def eval_step(self, batch: GlobalBatch, reg_value: float) -> None:
        """Forward-only pass of one batch: loss and metrics accumulate at the last stage."""
        pieces = self._microbatches(batch, self.strategy.microbatches)
        losses = self._run_schedule(pieces, batch.size, train=False)
        self._track_loss(losses, reg_value, self._added_total())

    def predict_step(self, batch: GlobalBatch) -> list | None:
        """Forward-only pass; the last stage returns its shard's outputs (micro-batch list)."""
        pieces = self._microbatches(batch, self.strategy.microbatches)
        return self._run_schedule(pieces, batch.size, train=False, predict=True)

    def regularization(self) -> float:
        """The model's total weight regularization (collective over the pipeline)."""
        return self._sum_over_pipeline(float(self._reg_fn()[0]) if self._regularized else 0.0)

    def _added_total(self) -> float:
        """This step's added losses (`add_loss`, activity regularization) of this replica's
        pipeline, each micro-batch's weighted by its size (collective over the pipeline once
        any stage's layers add losses)."""
        parts, self._added_parts = self._added_parts, []
        if self._any_added_losses is None:  # known once every stage has traced its calls
            pieces = self.topology.num_replicas * self.strategy.microbatches
            warn_unless_batch_means(self._loss_adders, pieces)
            with self.watchdog.guard("agree on added losses"):
                self._any_added_losses = bool(
                    self.topology.pipeline_comm.allreduce(
                        bool(self.runner.has_added_losses), op=_mpi_op("LOR")
                    )
                )
        if not self._any_added_losses:
            return 0.0
        local = sum(n * float(added) for n, added in parts)
        with self.watchdog.guard("sum added losses over the pipeline"):
            return self.topology.pipeline_comm.allreduce(local)

    def _track_loss(self, losses, reg_value: float, added: float = 0.0) -> None:
        """Feed Keras's loss tracker so that its mean equals Keras's (loss + added losses +
        regularization)."""
        if not self.is_last or not losses:
            return
        count = sum(n for _, n in losses)
        mean = (sum(float(loss) * n for loss, n in losses) + added) / count
        self._loss_tracker_fn(tf.constant(mean + reg_value), tf.constant(float(count)))

    def _run_schedule(self, pieces, global_size: int, *, train: bool, predict=False):
        """Walk this stage's actions for the micro-batches; return the last stage's results."""
        if not pieces:
            return []
        topo = self.topology
        count = len(pieces)
        if self.plan is None:
            prev = nxt = None
        else:
            largest = max(piece[3] for piece in pieces)
            prev, nxt = self._links(largest, count)
        actions = self._stage_actions(train, count)
        guard = self.watchdog.guard
        grid = topo.grid
        before = grid.rank_of(topo.stage - 1, topo.replica) if not self.is_first else None
        after = grid.rank_of(topo.stage + 1, topo.replica) if not self.is_last else None
        span = self._span
        # every stage: losses added in an earlier stage are scaled like the last stage's
        loss_scale = self._loss_scale() if train else 1.0
        posted = self._post_receives(prev, count)
        seeds = _SeedSnapshot(self._seed_states()) if train and count > 1 else None
        if train and not self.is_first and self.runner.flat_backward:
            # Pack while this stage waits for its first activations, off the critical path.
            with span(events.FORWARD):
                self.runner.prepare()
        results = []
        final_backward = max(
            (i for i, a in enumerate(actions) if not a.is_forward), default=-1
        )  # the step's last backward: every gradient of this stage is final after it
        for index, action in enumerate(actions):
            k = action.microbatch
            x, y, sw, n, offset = pieces[k]
            if action.is_forward:
                if seeds is not None:  # every micro-batch draws from the step's seeds
                    seeds.restore()
                if self.is_first:
                    inputs = self._first_stage_inputs(x)
                else:
                    with span(events.RECV, k), guard("receive activations", before, k):
                        inputs = posted.pop((FORWARD, k)).wait(n)
                with span(events.FORWARD, k):
                    if train:
                        out = self.runner.forward(
                            k,
                            inputs,
                            (y, sw),
                            scale=n / global_size * loss_scale,
                            piece=(offset, global_size),
                        )
                    else:
                        out = self.runner.infer(inputs)
                    if not predict:
                        self._added_parts.append((n, self.runner.last_added))
                    if self.is_last:
                        results.append(self._finish_forward(out, y, sw, n, train, predict))
                if not self.is_last:
                    with span(events.SEND, k):
                        nxt.isend(out, k, FORWARD)
                        if train:  # its gradients cannot come back before it has gone
                            posted[BACKWARD, k] = self._receive(nxt, k, BACKWARD)
            else:
                grads = None
                if not self.is_last:
                    with span(events.RECV, k), guard("receive gradients", after, k):
                        grads = posted.pop((BACKWARD, k)).wait(n)
                with span(events.BACKWARD, k):
                    if self._overlap is not None and index == final_backward:
                        input_grads = self.runner.backward(k, grads, self._on_segment_done)
                    else:
                        input_grads = self.runner.backward(k, grads)
                if not self.is_first:
                    with span(events.SEND, k):
                        prev.isend([g for g in input_grads if g is not None], k, BACKWARD)
        with span(events.SEND), guard("complete sends to pipeline neighbours"):
            for channel in (prev, nxt):
                if channel is not None:
                    channel.wait_sends()
        return results

    def _stage_actions(self, train: bool, count: int) -> tuple:
        """This stage's actions for a step of `count` micro-batches (built once per count)."""
        key = (train, count)
        if key not in self._schedules:
            topo = self.topology
            if train:
                schedule = make_schedule(self.strategy.schedule, topo.num_stages, count)
            else:
                schedule = forward_only(topo.num_stages, count)
            self._schedules[key] = tuple(schedule[topo.stage])
        return self._schedules[key]

    def _post_receives(self, prev, count: int) -> dict:
        """The step's activation receives, posted up front so that transfers land while this
        stage computes (a gradient receive is posted when its activation leaves, by the
        schedule walk: at the first stage, posting them all here would delay its first forward,
        which every later stage waits for)."""
        if prev is None:
            return {}
        return {(FORWARD, k): self._receive(prev, k, FORWARD) for k in range(count)}

    def _receive(self, channel, k: int, direction: str):
        """Micro-batch `k`'s receive from `channel`: posted now with `overlap_p2p`, else a
        blocking receive posted when waited for."""
        if self.strategy.overlap_p2p:
            return channel.irecv(k, direction)
        return _DeferredReceive(channel, k, direction)

    def _finish_forward(self, out, y, sw, n, train, predict):
        if predict:
            # Copy: forwarded outputs may be views of receive buffers reused next step.
            return tree.map_structure(lambda t: np.array(t, copy=True), out)
        if train:
            y_pred, loss = out
        else:
            y_pred = out
            loss = self._eval_loss_fn(y, y_pred, sw)
        if not (train and self.runner.updates_metrics):
            self._update_metrics_fn(y, y_pred, sw)
        return loss, n

    @property
    def _eval_loss_fn(self):
        if not hasattr(self, "_eval_loss_compiled"):
            self._eval_loss_compiled = tf.function(self._loss)
        return self._eval_loss_compiled

    # --- results shared by every rank ------------------------------------------------------
    def logs(self) -> dict:
        """Loss and metrics of the data seen since the last reset, identical on every rank."""
        with self.watchdog.guard("share loss and metrics", peer=self._log_root):
            logs = None
            if self.is_last:
                logs = self._replica_metrics()
            return self.topology.world.bcast(logs, root=self._log_root)

    def _seed_states(self) -> list:
        """The state variables of this stage's random layers' seed generators."""
        if not hasattr(self, "_seed_variables"):
            graph = self.model if self.plan is None else self.stage.model
            self._seed_variables = _seed_variables(self.model, graph)
        return self._seed_variables

    def _forward_state(self, graph=None) -> list:
        """Variables a forward pass of `graph` (default: this stage) changes: statistics and
        random seed states of its layers."""
        if graph is None:
            graph = self.model if self.plan is None else self.stage.model
        return list(graph.non_trainable_variables) + _seed_variables(self.model, graph)

    # --- what a checkpoint needs --------------------------------------------------------
    def owned_weight_indices(self) -> list[int]:
        """Indices in `model.weights` whose latest value this stage holds (it writes them)."""
        if self.plan is None:
            return list(range(len(self.model.weights))) if self.is_first else []
        owners = _weight_owners(self.plan, self.model)
        return [i for i, owner in enumerate(owners) if owner == self.topology.stage]

    def runs_layer(self, layer) -> bool:
        """Whether this stage calls `layer` (so its random state advances here)."""
        if self.plan is None:
            return self.is_first
        if not hasattr(self, "_layer_ids"):
            self._layer_ids = {id(x) for x in self.stage.model._flatten_layers()}
        return id(layer) in self._layer_ids

    def summed_metric_states(self) -> list:
        """The last stage's metric states summed over replicas ([] on other stages)."""
        if not self.is_last:
            return []
        local = [np.asarray(v.numpy()) for v in self.model.metrics_variables]
        with self.watchdog.guard("sum metric states over replicas"):
            return [self.topology.stage_comm.allreduce(a) for a in local]

    def restore_metric_states(self) -> None:
        """Put back the metric sums of a resumed epoch (once, on the last stage's replica 0)."""
        states, self.pending_metric_states = self.pending_metric_states, []
        if self.is_last and self.topology.replica == 0 and states:
            for variable, value in zip(self.model.metrics_variables, states):
                variable.assign(value)

    def agree_any(self, flag) -> bool:
        """True on every rank if `flag` is true on any rank (early stop, NaN stop)."""
        with self.watchdog.guard("agree on stopping"):
            return bool(self.topology.world.allreduce(bool(flag), op=_mpi_op("LOR")))

    def finalize_variables(self) -> None:
        """What Keras's fit does once training ends: the optimizer's last word on the variables
        (with `use_ema=True`, their moving averages), on each stage's own variables."""
        optimizer = self.model.optimizer
        if self.variables and getattr(optimizer, "built", False):
            optimizer.finalize_variable_values(self.variables)

    def sync_weights(self) -> None:
        """Give every rank the full model: each stage broadcasts the weights it owns."""
        if self.plan is None:
            return  # replicas stay identical: every one applies the same reduced gradients
        comm = self.topology.pipeline_comm
        owners = _weight_owners(self.plan, self.model)
        for root in range(self.topology.num_stages):
            mine = [v for v, owner in zip(self.model.weights, owners) if owner == root]
            if not mine:
                continue
            if comm.Get_rank() == root:
                flat = _packed(mine)
            else:
                flat = np.empty(sum(int(np.prod(v.shape)) for v in mine), np.float64)
            with self.watchdog.guard("share trained weights", peer=root):
                comm.Bcast(flat, root=root)
            if comm.Get_rank() != root:
                _assign_packed(mine, flat)

    def close(self) -> None:
        self.watchdog.close()
        for channels in self._channels.values():
            for channel in channels:
                if channel is not None:
                    channel.close()
        self.topology.free()


class _SeedSnapshot:
    """Seed generator states at a step's start, put back before each micro-batch's forward, so
    that every piece draws from the seeds one full-batch call would draw from."""

    def __init__(self, variables: list):
        self.variables = variables
        self.values = [tf.identity(v.value) for v in variables]

    def restore(self) -> None:
        for variable, value in zip(self.variables, self.values):
            variable.assign(value)


class _DeferredReceive:
    """A receive posted only when waited for: the blocking path (`overlap_p2p=False`)."""

    def __init__(self, channel, k: int, direction: str):
        self.channel, self.k, self.direction = channel, k, direction

    def wait(self, n: int):
        return self.channel.recv(self.k, self.direction, n)


class _Overlap:
    """Which gradients are final after which segment, and the reduction order that follows."""

    def __init__(self, order: list[int], ready_at: dict):
        self.order = order  # stage variable indices, in the order they become final
        self.ready_at = ready_at  # segment -> [(position in order, variable)]
        self.started: set[int] = set()
        self.early_starts = 0  # gradients handed to the reducer during a backward (all steps)

    @classmethod
    def plan(cls, sub_plan, variables: list) -> _Overlap:
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


def _owned_variables(plan, stage_index: int) -> list:
    """Trainable variables whose regularization this stage counts: those first used here."""
    first_user = {}
    for stage in plan.stages:
        for v in stage.model.trainable_variables:
            first_user.setdefault(id(v), stage.index)
    return [
        v for v in plan.stages[stage_index].model.trainable_variables
        if first_user[id(v)] == stage_index
    ]  # fmt: skip


def _weight_owners(plan, model) -> list:
    """For each of `model.weights`, the first stage that uses it (it holds the latest value)."""
    first_user = {}
    for stage in plan.stages:
        for v in stage.model.weights:
            first_user.setdefault(id(v), stage.index)
    return [first_user.get(id(v), 0) for v in model.weights]


def _packed(variables) -> np.ndarray:
    """The values of `variables` in one float64 buffer (for one MPI call)."""
    return np.concatenate([np.asarray(v.numpy(), np.float64).ravel() for v in variables])


def _assign_packed(variables, flat: np.ndarray) -> None:
    """Assign `variables` their values from a `_packed` buffer."""
    offset = 0
    for v in variables:
        size = int(np.prod(v.shape))
        v.assign(flat[offset : offset + size].reshape(v.shape).astype(v.dtype))
        offset += size


def _seed_variables(model, graph) -> list:
    """The state variables of the seed generators of `graph`'s layers (part of `model`)."""
    from hyparflow.checkpoint.state import layers_of_seed_keys, seed_generators

    layers = {id(layer) for layer in graph._flatten_layers()}
    owners = layers_of_seed_keys(model)
    return [var for key, var in seed_generators(model) if id(owners[key]) in layers]


def _unsynchronized_moving_statistics(layers, strategy) -> list:
    """Moving mean and variance of the BatchNormalization layers that normalise alone."""
    import keras

    from hyparflow.engine.sync_batchnorm import synchronized_layers

    synced = {id(layer) for layer in synchronized_layers(layers, strategy.sync_batchnorm)}
    return [
        v
        for layer in layers
        if isinstance(layer, keras.layers.BatchNormalization) and id(layer) not in synced
        for v in (layer.moving_mean, layer.moving_variance)
    ]


def _has_varying_dimensions(model, stage) -> bool:
    """Whether the inputs of `stage` (or of the whole `model`) have unknown dimensions besides
    the batch, e.g. a sequence length that varies from batch to batch."""
    if stage is not None:
        shapes = [tuple(t.shape) for t in stage.receives]  # without the batch dimension
    else:
        shapes = [tuple(t.shape)[1:] for t in getattr(model, "inputs", None) or []]
    return any(d is None for shape in shapes for d in shape)


def _inner(optimizer):
    """The optimizer that clips: a LossScaleOptimizer's inner one."""
    return optimizer.inner_optimizer if isinstance(optimizer, LossScaleOptimizer) else optimizer


def _sum_of_squares(grads, loss_scale):
    """Keras's squared global norm of `grads` (row slices count each pair), unscaled."""
    return ops.sum(ops.stack([ops.sum(ops.square(g)) for g in grads])) / ops.square(loss_scale)


def _finite(grad) -> bool:
    return bool(tf.reduce_all(tf.math.is_finite(rows.values_of(grad))))


def _mpi_op(name: str):
    from mpi4py import MPI

    return getattr(MPI, name)
