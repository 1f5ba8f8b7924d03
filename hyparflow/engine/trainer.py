"""One rank's share of training: its stage of its replica's pipeline, step by step.

A step walks the stage's schedule over the micro-batches of its replica's shard
(`pipeline.PipelineWalk`), sums the gradients across the stages that share a layer and across
replicas (`gradient_sync.GradientSync`), and applies the optimizer with the weight
regularization added once (`update.Update`). The loss of each micro-batch is its mean times its
share of the global batch, so the summed gradient is exactly the gradient of Keras's loss on
the whole global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses

import tensorflow as tf

from hyparflow import _keras, deferred
from hyparflow.comm.topology import Topology
from hyparflow.comm.traffic import TrafficLog
from hyparflow.comm.watchdog import NoWatchdog, Watchdog
from hyparflow.data import GlobalBatch
from hyparflow.engine import events
from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.engine.gradients.flat import FlatLayout
from hyparflow.engine.gradients.form import choose_gradient_form
from hyparflow.engine.gradients.mpi import mpi_op
from hyparflow.engine.gradients.path import build_gradient_path
from hyparflow.engine.gradients.segment_update import (
    SegmentUpdate,
    segment_count,
    segment_parts,
)
from hyparflow.engine.gradients.sync import GradientSync, SharedAcrossStages
from hyparflow.engine.gradients.update import Update
from hyparflow.engine.keras_semantics.added_losses import (
    refuse_unless_batch_means,
    warn_unless_batch_means,
)
from hyparflow.engine.keras_semantics.metrics import ReplicaMetrics, build_outside_the_trace
from hyparflow.engine.keras_semantics.output_losses import OutputLosses
from hyparflow.engine.keras_semantics.split_layers import SplitLayers
from hyparflow.engine.keras_semantics.sync_batchnorm import synchronized_layers
from hyparflow.engine.sharded_optimizer.checkpoint import ZeroCheckpoint
from hyparflow.engine.sharded_optimizer.sharded_update import ShardedUpdate
from hyparflow.engine.stage_state import TrainingState
from hyparflow.engine.stages.make_runner import (
    RunnerParts,
    build_chunk_runners,
    build_runner,
    build_segmented_runner,
    seed_variables,
    unsynchronized_moving_statistics,
)
from hyparflow.engine.stages.structure import model_input_list, pack_model_outputs
from hyparflow.engine.stages.walk import Chunk, PipelineWalk
from hyparflow.engine.weights import (
    assign_packed,
    broadcast_owned_weights,
    owned_variables,
    packed,
    rank_variables,
)
from hyparflow.moe import expert_parallel
from hyparflow.tensor import collectives
from hyparflow.traced import traced

__all__ = ["Trainer", "model_input_list", "pack_model_outputs"]


def _training_state_field(name: str, doc: str) -> property:
    """A Trainer attribute that is `stage_state`'s field `name` (checkpoints save that state)."""
    return property(
        lambda trainer: getattr(trainer.stage_state, name),
        lambda trainer, value: setattr(trainer.stage_state, name, value),
        doc=doc,
    )


class Trainer:
    """Training, evaluation and prediction steps for this rank's (stage, replica).

    `plan` is None for data parallelism (the whole user model is the only stage, so any model
    works, subclassed ones included); otherwise the partitioner's `Plan`. `comm_backend` sums
    gradients across replicas ("mpi" or "horovod").

    Its parts: `runner` (the stage's forward and backward), `walk` (the schedule over
    micro-batches and channels), `gradient_sync` (every gradient reduction), `update` (the
    optimizer step) and `stage_state` (what checkpoints save and restore). `traffic`: the
    `TrafficLog` its in-graph collectives count in (the profiler reads it).
    """

    def __init__(
        self, model, strategy, comm, plan=None, watchdog_timeout: float = 0.0,
        comm_backend: str = "mpi", tensor_layout=None, row_kinds=row_sparse.UNPROBED,
    ):  # fmt: skip
        self.model = model
        self.strategy = strategy
        self.plan = plan
        self.topology = topo = Topology.create(
            comm, strategy.partitions, strategy.replicas, strategy.tensor
        )
        self.check_numerics = False
        self.watchdog = NoWatchdog()
        self.use_watchdog(watchdog_timeout)
        self.is_first = topo.is_first_stage
        self.is_last = topo.is_last_stage
        # the partitioner's stages this rank runs: one, or several when interleaved
        self.stages = [None] if plan is None else plan.stages_on(topo.stage)
        # Built under hf.scope(): weights of other stages were never allocated on this rank.
        self.holds_share_only = any(deferred.is_deferred(v) for v in model.variables)
        # tensor shards, expert shards, sparse mixtures (docs/tensor.md, docs/moe.md)
        graphs = [model] if plan is None else [s.model for s in self.stages]
        self.traffic = TrafficLog()  # this trainer's alone: its parts are handed its records
        self.splits = SplitLayers(
            model, strategy, topo, graphs, tensor_layout, self.guard, traffic=self.traffic
        )
        self.shards, self.experts = self.splits.tensor, self.splits.experts
        self.row_kinds = row_kinds.with_shards(model, self.splits.pieces()[1])
        self.sparse_experts = self.splits.dispatch
        with self.layers_active():  # everything below sees (and traces) shards and experts
            self._build(model, strategy, plan, topo, comm_backend)

    def _build(self, model, strategy, plan, topo, comm_backend):
        """Wire the parts: variables, runner, gradient path, pipeline walk, saved state."""
        self.output_losses = OutputLosses(model)  # per-output loss means weighted as Keras's
        layers = self._find_variables(model, plan, topo)
        shared = SharedAcrossStages.find(plan, model, self.variables, self.row_kinds)
        self._loss_adders: set = set()  # layers calling add_loss, found while tracing
        self._any_added_losses = None  # whether any stage's layers add losses (agreed once)
        self._moving_statistics = unsynchronized_moving_statistics(layers, strategy.sync_batchnorm)
        self.splits.synchronized = bool(synchronized_layers(layers, strategy.sync_batchnorm))
        parts = [self._runner_parts(stage) for stage in self.stages]
        self.runner, self.gradient_form, segments = self._build_runner(
            parts, shared is not None, comm_backend
        )
        self._update_metrics_fn = traced(self._update_metrics, reduce_retracing=True)
        # Compiled like Keras's own step: metric updates and results are a call each.
        self._loss_tracker_fn = traced(
            lambda value, count: _keras.loss_tracker(model).update_state(value, sample_weight=count)
        )
        self._replica_metrics = ReplicaMetrics(model, topo.stage_comm)
        self._build_gradient_path(shared, segments, comm_backend)
        runners = self.runner.runners if len(parts) > 1 else [self.runner]
        chunks = [
            Chunk(p.stage, runner, p.is_first, p.is_last, seed_variables(model, p.graph))
            for p, runner in zip(parts, runners, strict=True)
        ]
        self.walk = PipelineWalk(
            model, topo, strategy, chunks, guard=self.guard, loss=self._loss,
            update_metrics=self._update_metrics_fn, whole_inputs=plan is None and segments is None,
        )  # fmt: skip
        self.stage_state = TrainingState(
            model, topo, plan, self.variables, self.guard, *self.splits.pieces(),
            experts=strategy.experts,
            optimizer_shard=None if self.zero is None else ZeroCheckpoint(self.zero),
        )  # fmt: skip
        self._log_root = topo.grid.rank_of(topo.num_stages - 1, 0)
        self.attach_recorder(None)

    def _runner_parts(self, stage) -> RunnerParts:
        """What the runner of `stage` (None: the whole model) is built from."""
        call = self._call_whole_model if stage is None else self._stage_call(stage)
        return RunnerParts(
            self.model, stage, self.topology, self.strategy, call=call, loss=self._loss,
            metrics=self._update_metrics, loss_adders=self._loss_adders, tally=self.splits.tally,
            row_kinds=self.row_kinds, traffic=self.traffic,
        )  # fmt: skip

    def _find_variables(self, model, plan, topo) -> list:
        """The rank's trainable variables (of every stage it runs), those it owns, its
        embedding tables (row-sparse gradients) and dense ones; returns the stages' layers."""
        if plan is None:
            self.variables = list(model.trainable_variables)
            self.owned = list(self.variables)
            layers = _keras.all_layers(model)
        else:
            self.variables = rank_variables(plan, topo.stage)
            self.owned = owned_variables(plan, topo.stage)
            layers = list(dict.fromkeys(x for s in self.stages for x in _keras.all_layers(s.model)))
        self.sparse = row_sparse.row_sparse_positions(self.variables, layers, self.row_kinds)
        self.dense = sorted(set(range(len(self.variables))) - set(self.sparse))
        return layers

    def _build_runner(self, parts, shared_across_stages: bool, comm_backend: str) -> tuple:
        """(the stage's runner, the gradient form its facts call for, its segments: None
        unless the runner cuts the stage into segments)."""
        strategy, topo = self.strategy, self.topology
        layout = FlatLayout([self.variables[i] for i in self.dense])
        # a split backward's weight gradients are final only after the step's last W, and
        # interleaved chunks end their backwards apart: neither is cut into segments; nor is a
        # stage whose router losses one runner tallies
        whole = strategy.schedule in ("zero_bubble", "interleaved") and self.plan is not None
        whole = whole or self.splits.tally is not None
        facts = dict(
            partitioned=self.plan is not None,
            replicas=topo.num_replicas,
            backend=comm_backend,
            flat_gradients=strategy.flat_gradients,
            dense_variables=len(self.dense),
            all_float32=layout.usable,
            large_variables=layout.large_variables,
            shared_across_stages=shared_across_stages,
            tables=len(self.sparse),
            rows_classified=self.row_kinds.complete,
            segments=1 if whole else segment_count(strategy, self.model, self.variables),
            tensor_split=self.shards is not None,
            expert_split=self.experts is not None,
        )
        form = choose_gradient_form(**facts, overlap_groups=strategy.overlap_groups)
        if len(parts) > 1:  # interleaved: a runner per chunk, their gradients summed
            # no chunk packs a flat backward; the rank's sums flat only to be reduced
            form = dataclasses.replace(form, flat_backward=False)
            runner = build_chunk_runners(parts, self.variables, self.sparse, form, layout)
            return runner, form, None
        if form.overlap or form.update_per_segment:
            count = strategy.overlap_groups if strategy.overlap_groups > 1 else facts["segments"]
            segmented = build_segmented_runner(parts[0], self.variables, count)
            if segmented is not None:
                return segmented[0], form, segmented[1]
            # the stage cannot be cut: reduce after the backward
            form = choose_gradient_form(**{**facts, "segments": 1})
        return build_runner(parts[0], self.variables, self.sparse, form, layout), form, None

    def _build_gradient_path(self, shared, segments, comm_backend: str) -> None:
        """Reduction across stages and replicas, the optimizer step, the update by segment and
        ZeRO-1's sharded update, as the gradient form asks."""
        model, topo, form = self.model, self.topology, self.gradient_form
        self.gradient_sync = GradientSync(
            topo, self.runner, self.variables, self.dense, self.sparse,
            backend=comm_backend, shared=shared, overlap=segments if form.overlap else None,
            experts=self.experts, row_kinds=self.row_kinds,
        )  # fmt: skip
        self.update = Update(
            model, topo, self.variables, self.owned, partitioned=self.plan is not None,
            guard=self.guard, merge=self.gradient_sync.merge, layout=self.runner.layout,
            split=self.shards.variables if self.shards else (),
            expert_split=self.splits.expert_split(),
        )  # fmt: skip
        # ZeRO-1: the replicas split the optimizer state and its update
        # (engine/sharded_optimizer/sharded_update.py); by segment, each segment is
        # reduce-scattered, its slice updated, its parameters gathered as soon as the last
        # backward has finished it
        parts = segment_parts(self.variables, segments) if form.update_per_segment else None
        self.zero = None
        if self.strategy.shard_optimizer and topo.num_replicas > 1:
            self.zero = ShardedUpdate(
                model, topo, self.variables, self.update, self.gradient_sync, segments=parts
            )  # fmt: skip
        self.segment_update = None
        if form.update_per_segment:
            replicas = topo.stage_comm if topo.num_replicas > 1 else None
            self.segment_update = SegmentUpdate(
                self.update, self.runner, segments, replicas=replicas, guard=self.guard,
                zero=self.zero,
            )  # fmt: skip
        self.gradient_path = build_gradient_path(
            self.gradient_sync, self.update, self.segment_update, self.zero,
            # a lambda: attach_recorder replaces `_span` (`guard` reads the current watchdog)
            span=lambda *kind: self._span(*kind), guard=self.guard, step=lambda: self.step,
        )  # fmt: skip

    def layers_active(self) -> contextlib.ExitStack:
        """The layers as this rank runs them: its tensor and expert shards, and keras_hub
        mixture blocks' experts dispatched sparsely (`SplitLayers`)."""
        return self.splits.active()

    def load_shards(self) -> None:
        """Slice the model's current weights into this rank's tensor and expert shards (each
        fit, evaluate or predict starts from the model as the user holds it)."""
        self.splits.load()

    # --- what checkpoints and callbacks read ---------------------------------------------
    step = _training_state_field("step", "Optimizer steps taken through this trainer.")
    seed = _training_state_field(
        "seed", "The shared shuffle seed of the current fit (checkpoints record it)."
    )

    def use_watchdog(self, timeout: float) -> None:
        """Guard blocking MPI waits with a `timeout`-second watchdog (0: none)."""
        if getattr(self.watchdog, "timeout", 0) == timeout:
            return
        self.watchdog.close()
        self.watchdog = Watchdog(self.topology.world, timeout) if timeout > 0 else NoWatchdog()

    def guard(self, operation: str, peer=None, microbatch=None):
        """The current watchdog's guard (the watchdog changes with `use_watchdog`)."""
        return self.watchdog.guard(operation, peer, microbatch)

    def attach_recorder(self, recorder: events.Recorder | None) -> None:
        """Record timed spans of each training step into `recorder` (None: record nothing)."""
        self.recorder = recorder
        self._span = events.no_span if recorder is None else recorder.span
        self._step_span = events.no_step if recorder is None else recorder.step
        self.walk.span = self._span
        # each tensor collective, expert exchange or experts' compute, as it ends, is a span
        inner = (
            (self.shards, (collectives.TAG,), events.TENSOR),
            (self.experts, expert_parallel.SPAN_TAGS, events.EXPERTS),
        )
        for split, tags, kind in inner:
            if split is not None:
                listener = None if recorder is None else events.span_listener(recorder, kind)
                self.traffic.listen(tags, listener)

    # --- what a stage computes ------------------------------------------------------------
    def _call_whole_model(self, x, training):
        return self.model(x, training=training)

    def _stage_call(self, stage):
        """`call(inputs, training)` of the partitioner's `stage`: the model's outputs as Keras
        packs them at the model's last stage, a flat list elsewhere."""
        last = stage.index == len(self.plan.stages) - 1

        def call(inputs, training):
            outputs = stage.forward(inputs, training=training)
            flat = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            return pack_model_outputs(self.model, flat) if last else flat

        return call

    def _loss(self, y, y_pred, sample_weight):
        return self.output_losses(y, y_pred, sample_weight)

    def _update_metrics(self, y, y_pred, sample_weight):
        metrics = _keras.compiled_metrics(self.model)
        if metrics is None:
            return
        if not metrics.built:
            build_outside_the_trace(metrics, y, y_pred)
        metrics.update_state(y, y_pred, sample_weight)

    # --- steps ---------------------------------------------------------------------------
    def train_step(self, batch: GlobalBatch) -> None:
        """One optimizer step on one global batch (collective over every rank)."""
        with self.layers_active():
            self.optimizer_step(batch)

    def optimizer_step(self, batch: GlobalBatch) -> None:
        """One optimizer step on `batch`, the layers already active (`train_step`): the seam
        where a trainer of another kind of step plugs in (`CustomStepTrainer`)."""
        microbatches = self._microbatches(batch, training=True)
        self.output_losses.begin(batch.size)
        on_segment_done = self.gradient_path.begin(self.check_numerics)
        with self._step_span(batch.size, len(microbatches)):
            losses = self.walk.run(
                microbatches, batch.size, train=True, loss_scale=self.update.loss_scale(),
                on_segment_done=on_segment_done,
            )  # fmt: skip
            reg_value = self.gradient_path.finish(losses, self.check_numerics)
        self._track_loss(losses, reg_value, self._added_total())
        self._average_moving_statistics()
        self.step += 1
        self.watchdog.step = self.step

    def eval_step(self, batch: GlobalBatch, reg_value: float) -> None:
        """Forward-only pass of one batch: loss and metrics accumulate at the last stage."""
        self.output_losses.begin(batch.size)
        with self.layers_active():
            losses = self.walk.run(self._microbatches(batch), batch.size, train=False)
            self._track_loss(losses, reg_value, self._added_total())

    def predict_step(self, batch: GlobalBatch) -> list | None:
        """Forward-only pass; the last stage returns its shard's outputs (micro-batch list)."""
        microbatches = self._microbatches(batch)
        with self.layers_active():
            return self.walk.run(microbatches, batch.size, train=False, predict=True)

    def _microbatches(self, batch: GlobalBatch, training: bool = False) -> list:
        """This replica's micro-batches of `batch` (refused alike on every rank where one
        replica would get no rows while the others wait for it inside the step)."""
        self.splits.refuse_empty_replicas(batch.size, self.topology.num_replicas, training)
        return self.walk.microbatches(batch)

    def regularization(self) -> float:
        """The model's total weight regularization (collective over the pipeline)."""
        return self.update.regularization()

    def _added_total(self) -> float:
        """This step's added losses (`add_loss`, activity regularization) of this replica's
        pipeline, each micro-batch's weighted by its size (collective over the pipeline once
        any stage's layers add losses)."""
        parts = self.walk.take_added() + self.splits.take_router_parts()
        pipeline = self.topology.pipeline_comm
        if self._any_added_losses is None:  # known once every stage has traced its calls
            microbatches_per_batch = self.topology.num_replicas * self.strategy.microbatches
            # router losses and losses built from hf.global_mean are the global batch's
            exact = {block.name for block in self.sparse_experts.blocks} | self.splits.batch.users
            inexact = self._loss_adders - exact
            if self.strategy.strict_added_losses:
                with self.guard("agree on added losses"):
                    refuse_unless_batch_means(inexact, microbatches_per_batch, self.topology.world)
            warn_unless_batch_means(inexact, microbatches_per_batch)
            with self.guard("agree on added losses"):
                self._any_added_losses = bool(
                    pipeline.allreduce(bool(self.runner.has_added_losses), op=mpi_op("LOR"))
                )
        if not self._any_added_losses:
            return 0.0
        local = sum(n * float(added) for n, added in parts)
        with self.guard("sum added losses over the pipeline"):
            return pipeline.allreduce(local)

    def _track_loss(self, losses, reg_value: float, added: float = 0.0) -> None:
        """Feed Keras's loss tracker so that its mean equals Keras's (loss + added losses +
        regularization)."""
        if not self.is_last or not losses:
            return
        count = sum(n for _, n in losses)
        mean = (sum(float(loss) * n for loss, n in losses) + added) / count
        self._loss_tracker_fn(tf.constant(mean + reg_value), tf.constant(float(count)))

    def _average_moving_statistics(self) -> None:
        """Replicas that normalise their shards alone average their moving statistics after
        each step (for the mean, Keras's update on the global batch), so they never drift."""
        variables = self._moving_statistics
        if not variables or self.topology.num_replicas == 1:
            return
        flat = packed(variables)
        with self.guard("average moving statistics over replicas"):
            self.topology.stage_comm.Allreduce(mpi_op("IN_PLACE"), flat)
        assign_packed(variables, flat / self.topology.num_replicas)

    # --- results shared by every rank ------------------------------------------------------
    def logs(self) -> dict:
        """Loss and metrics of the data seen since the last reset, identical on every rank."""
        with self.guard("share loss and metrics", peer=self._log_root):
            logs = None
            if self.is_last:
                logs = self._replica_metrics()
            return self.topology.world.bcast(logs, root=self._log_root)

    def restore_metric_states(self) -> None:
        """Add the checkpoint's metric sums to a resumed epoch's (stage_state.py)."""
        self.stage_state.restore_metric_states()

    def agree_any(self, flag) -> bool:
        """True on every rank if `flag` is true on any rank (early stop, NaN stop)."""
        with self.guard("agree on stopping"):
            return bool(self.topology.world.allreduce(bool(flag), op=mpi_op("LOR")))

    def finalize_variables(self) -> None:
        """What Keras's fit does once training ends: the optimizer's last word on the variables
        (with `use_ema=True`, their moving averages), on each stage's own variables."""
        optimizer = self.model.optimizer
        if self.variables and getattr(optimizer, "built", False):
            optimizer.finalize_variable_values(self.variables)

    def sync_weights(self) -> None:
        """Give every rank the full model: each stage broadcasts the weights it owns. A model
        built under hf.scope() stays where it is: each rank keeps its own share."""
        self.splits.store(self.guard)  # first put split weights together
        if self.plan is None or self.holds_share_only:
            return  # replicas stay identical: every one applies the same reduced gradients
        broadcast_owned_weights(self.model, self.plan, self.topology.pipeline_comm, self.guard)

    def close(self) -> None:
        self.watchdog.close()
        self.walk.close()
        self.splits.free()
        self.topology.free()
