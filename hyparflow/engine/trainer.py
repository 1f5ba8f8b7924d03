"""One rank's share of training: its stage of its replica's pipeline, step by step.

`build_parts` is the engine's composition root: it builds every part of a rank's trainer once,
into the immutable `TrainerParts`. A step (`Trainer.optimizer_step`) walks the stage's schedule
over the micro-batches of its replica's shard (`stages/walk.py`), sums the gradients across the
stages that share a layer and across replicas (`gradients/sync.py`), and applies the optimizer
with the weight regularization added once (`gradients/update.py`). The loss of each
micro-batch is its mean times its share of the global batch, so the summed gradient is exactly
the gradient of Keras's loss on the whole global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import tensorflow as tf

from hyparflow import _keras, deferred
from hyparflow.comm.agree import same_ranks
from hyparflow.comm.topology import Topology
from hyparflow.comm.traffic import TrafficLog
from hyparflow.comm.watchdog import Guard
from hyparflow.data import GlobalBatch
from hyparflow.engine import events
from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.engine.gradients.flat import FlatLayout
from hyparflow.engine.gradients.form import GradientForm, choose_gradient_form
from hyparflow.engine.gradients.mpi import mpi_op
from hyparflow.engine.gradients.path import build_gradient_path
from hyparflow.engine.gradients.segment_update import (
    SegmentUpdate,
    segment_count,
    segment_positions,
)
from hyparflow.engine.gradients.sync import GradientSync, Overlap, SharedAcrossStages
from hyparflow.engine.gradients.update import Update
from hyparflow.engine.keras_semantics.added_losses import (
    refuse_unless_batch_means,
    warn_unless_batch_means,
)
from hyparflow.engine.keras_semantics.metrics import ReplicaMetrics, compiled_metrics_update
from hyparflow.engine.keras_semantics.output_losses import OutputLosses
from hyparflow.engine.keras_semantics.sharded_layers import ShardedLayers, store_after_failure
from hyparflow.engine.keras_semantics.sync_batchnorm import synchronized_layers
from hyparflow.engine.sharded_optimizer.checkpoint import SliceCheckpoint
from hyparflow.engine.sharded_optimizer.sharded_update import ShardedUpdate, sliced_segments
from hyparflow.engine.sharded_optimizer.sharded_weights import ShardedWeights
from hyparflow.engine.stage_state import TrainingState
from hyparflow.engine.stages.layer_gathering import LayerGathering, layer_positions
from hyparflow.engine.stages.make_runner import (
    RunnerParts,
    build_chunk_runners,
    build_runner,
    build_segmented_runner,
    cut_stage,
    seed_variables,
    unsynchronized_moving_statistics,
)
from hyparflow.engine.stages.structure import model_input_list, pack_model_outputs, stage_call
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

__all__ = ["Trainer", "TrainerParts", "build_parts", "model_input_list", "pack_model_outputs"]


@dataclasses.dataclass(frozen=True)
class StageVariables:
    """The trainable variables of every stage a rank runs (`all`), those it owns (a variable
    shared by stages is owned by one), the positions in `all` of embedding tables (row-sparse
    gradients, `sparse`) and of the rest (`dense`), and the stages' layers."""

    all: list
    owned: list
    sparse: list
    dense: list
    layers: list


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a rank's parts are built for: its `topology` in the grid, the partitioner's `plan`
    (None: the whole model is the only stage), the `stages` of it this rank runs and their
    `layers`, the `guard` every blocking wait is watched with (`Guard.use` switches its
    watchdog), its `sharded_layers` (tensor shards, expert shards, sparse mixture dispatch),
    the model's row-sparse variables (`row_kinds`) and the `TrafficLog` its in-graph
    collectives count in (this trainer's alone)."""

    model: object
    strategy: object
    plan: object
    stages: list
    layers: list  # the layers of those stages, each once
    topology: Topology
    guard: Guard
    sharded_layers: ShardedLayers
    row_kinds: row_sparse.RowKinds
    traffic: TrafficLog  # what the rank's in-graph collectives moved (the profiler reads it)
    comm_backend: str  # sums gradients across replicas: "mpi" or "horovod"


@dataclasses.dataclass(frozen=True)
class TrainerParts:
    """Everything one rank's trainer runs, built once by `build_parts` (the engine's one
    composition root): each part gets what it works with as constructor arguments, and none is
    changed once built. `spans` chooses the recorder the parts time their work into;
    `loss_adders` collects the layers that add losses while the runners trace."""

    setting: Setting
    variables: StageVariables
    spans: events.Spans
    moving_statistics: list  # normalisation statistics the replicas average after each step
    output_losses: OutputLosses
    loss_adders: set
    runner: object  # the stage's forward and backward (`stages/runner.py` and its kinds)
    gradient_form: GradientForm
    walk: PipelineWalk
    gradient_sync: GradientSync
    update: Update
    sharded_update: ShardedUpdate | None  # ZeRO-1's sharded optimizer update, if any
    sharded_weights: ShardedWeights | None  # ZeRO-3's weight slices, if any
    segment_update: SegmentUpdate | None
    gradient_path: object  # `gradients/path.py`: reduction and update, as the form asks
    stage_state: TrainingState


def build_parts(model, strategy, comm, plan=None, **options) -> TrainerParts:
    """The parts of the trainer of this rank's (stage, replica) of `model` under `strategy` on
    `comm` (collective). `options`: `watchdog_timeout`, `comm_backend` ("mpi" or
    "horovod"), `tensor_layout`, `row_kinds`."""
    setting = _setting(model, strategy, comm, plan, options)
    with setting.sharded_layers.active():  # everything below sees (and traces) shards and experts
        variables = _stage_variables(setting)
        shared = SharedAcrossStages.find(plan, model, variables.all, setting.row_kinds)
        output_losses = OutputLosses(model)  # per-output loss means weighted as Keras's
        update_metrics = compiled_metrics_update(model)
        loss_adders: set = set()
        runner_parts = [
            _runner_parts(setting, stage, output_losses, update_metrics, loss_adders)
            for stage in setting.stages
        ]
        spans = events.Spans()
        runner, form, overlap, weights = _build_runner(
            setting, runner_parts, variables, shared, spans
        )
        sync, update, sharded, by_segment = _build_gradient_parts(
            setting, variables, runner, form, shared, overlap, weights
        )
        stage_state = _training_state(setting, variables, sharded, weights)
        gradient_path = build_gradient_path(
            sync,
            update,
            by_segment,
            sharded,
            span=spans.span,
            guard=setting.guard,
            step=lambda: stage_state.step,
        )
        walk = _build_walk(
            setting,
            runner_parts,
            runner,
            spans,
            output_losses,
            update_metrics,
            whole_inputs=plan is None and overlap is None,
        )
    moving_statistics = unsynchronized_moving_statistics(variables.layers, strategy.sync_batchnorm)
    return TrainerParts(
        setting,
        variables,
        spans,
        moving_statistics,
        output_losses,
        loss_adders,
        runner,
        form,
        walk,
        sync,
        update,
        sharded,
        weights,
        by_segment,
        gradient_path,
        stage_state,
    )


def _setting(model, strategy, comm, plan, options: dict) -> Setting:
    """The rank's `Setting`: its place in the grid, its stages and their split layers."""
    topology = Topology.create(comm, strategy.partitions, strategy.replicas, strategy.tensor)
    guard = Guard(topology.world, options.get("watchdog_timeout", 0.0))
    stages = [None] if plan is None else plan.stages_on(topology.stage)
    graphs = [model] if plan is None else [stage.model for stage in stages]
    layers = _layers_of(graphs)
    synchronized = bool(synchronized_layers(layers, strategy.sync_batchnorm))
    tensor_layout = options.get("tensor_layout")
    traffic = TrafficLog()
    sharded_layers = ShardedLayers(
        model, strategy, topology, graphs, tensor_layout, guard, synchronized, traffic=traffic
    )
    row_kinds = options.get("row_kinds", row_sparse.UNPROBED)
    row_kinds = row_kinds.with_shards(model, sharded_layers.pieces()[1])
    backend = options.get("comm_backend", "mpi")
    return Setting(
        model,
        strategy,
        plan,
        stages,
        layers,
        topology,
        guard,
        sharded_layers,
        row_kinds,
        traffic,
        backend,
    )


def _layers_of(graphs: list) -> list:
    """Every layer of `graphs` (Keras models), each once."""
    return list(dict.fromkeys(x for graph in graphs for x in _keras.all_layers(graph)))


def _runner_parts(setting, stage, output_losses, update_metrics, loss_adders) -> RunnerParts:
    """What the runner of `stage` (None: the whole model) is built from."""
    return RunnerParts(
        setting.model,
        stage,
        setting.topology,
        setting.strategy,
        call=stage_call(setting.model, setting.plan, stage),
        loss=output_losses,
        metrics=update_metrics,
        loss_adders=loss_adders,
        tally=setting.sharded_layers.tally,
        row_kinds=setting.row_kinds,
        traffic=setting.traffic,
    )


def _training_state(setting, variables, sharded, weights) -> TrainingState:
    """The stage as checkpoints save and restore it (ZeRO-1: with its optimizer slices;
    ZeRO-3: with its weights' slices while they are let go)."""
    return TrainingState(
        setting.model,
        setting.topology,
        setting.plan,
        variables.all,
        setting.guard,
        *setting.sharded_layers.pieces(),
        experts=setting.strategy.experts,
        optimizer_shard=None if sharded is None else SliceCheckpoint(sharded, weights),
    )


def _build_walk(
    setting, runner_parts, runner, spans, output_losses, update_metrics, whole_inputs
) -> PipelineWalk:
    """The schedule's walk over micro-batches, a chunk per runner (interleaved: several)."""
    runners = runner.runners if len(runner_parts) > 1 else [runner]
    chunks = [
        Chunk(p.stage, r, p.is_first, p.is_last, seed_variables(setting.model, p.graph))
        for p, r in zip(runner_parts, runners, strict=True)
    ]
    return PipelineWalk(
        setting.model,
        setting.topology,
        setting.strategy,
        chunks,
        guard=setting.guard,
        span=spans.span,
        loss=output_losses,
        update_metrics=traced(update_metrics, reduce_retracing=True),
        whole_inputs=whole_inputs,
    )


def _stage_variables(setting: Setting) -> StageVariables:
    """The rank's `StageVariables` (of every stage it runs)."""
    model, plan, layers = setting.model, setting.plan, setting.layers
    if plan is None:
        variables = list(model.trainable_variables)
        owned = list(variables)
    else:
        variables = rank_variables(plan, setting.topology.stage)
        owned = owned_variables(plan, setting.topology.stage)
    sparse = row_sparse.row_sparse_positions(variables, layers, setting.row_kinds)
    dense = sorted(set(range(len(variables))) - set(sparse))
    return StageVariables(variables, owned, sparse, dense, layers)


def _build_runner(setting: Setting, runner_parts, variables, shared, spans) -> tuple:
    """(the stage's runner, the gradient form its facts call for, its `Overlap`: which
    variables are final after each segment, None unless the runner cuts the stage into
    segments; ZeRO-3's `ShardedWeights`, None unless the strategy shards the weights of a
    stage cut into segments, its gathers timed into `spans`)."""
    layout = FlatLayout([variables.all[i] for i in variables.dense])
    facts = _gradient_facts(setting, variables, layout, shared_across_stages=shared is not None)
    form = choose_gradient_form(**facts, overlap_groups=setting.strategy.overlap_groups)
    if len(runner_parts) > 1:  # interleaved: a runner per chunk, their gradients summed
        # no chunk packs a flat backward; the rank's sums flat only to be reduced
        form = dataclasses.replace(form, flat_backward=False)
        runner = build_chunk_runners(runner_parts, variables.all, variables.sparse, form, layout)
        return runner, form, None, None
    if form.overlap or form.update_per_segment:
        groups = setting.strategy.overlap_groups
        count = groups if groups > 1 else facts["segments"]
        sub = cut_stage(runner_parts[0], count)
        if sub is not None:
            overlap = Overlap.plan(sub, variables.all)
            positions = segment_positions(variables.all, overlap, leave_out=variables.sparse)
            weights = _sharded_weights(setting, variables, positions, spans)
            runner = build_segmented_runner(
                runner_parts[0], variables.all, sub, variables.sparse, weights
            )
            return runner, form, overlap, weights
        # the stage cannot be cut: reduce after the backward
        form = choose_gradient_form(**{**facts, "segments": 1})
    # ZeRO-3 on a stage that is not cut: the whole model's layers gather their own weights in
    # its graph; a pipeline stage or tensor shards are gathered whole for each call (refused
    # up front with the zero-bubble and interleaved schedules: model_checks)
    gathering = None
    if _gathers_by_layer(setting, runner_parts[0]):
        positions = layer_positions(setting.model, variables.all, variables.dense)
        weights = _sharded_weights(setting, variables, positions, spans)
        comm = setting.topology.stage_comm
        gathering = LayerGathering(setting.model, weights, comm, setting.guard, setting.traffic)
    else:
        weights = _sharded_weights(setting, variables, None, spans)
    if weights is not None:
        form = dataclasses.replace(form, flat=False, flat_backward=False)
    runner = build_runner(
        runner_parts[0], variables.all, variables.sparse, form, layout, weights, gathering
    )
    return runner, form, None, weights


def _gathers_by_layer(setting: Setting, parts) -> bool:
    """Whether ZeRO-3 gathers the stage's weights layer by layer inside its graph: the whole
    model (no pipeline), its layers whole (no tensor shards, no router tally)."""
    strategy, topology = setting.strategy, setting.topology
    sharded = strategy.shard_weights and topology.num_replicas > 1
    whole = parts.stage is None and setting.sharded_layers.tensor is None
    return sharded and whole and parts.tally is None


def _sharded_weights(setting: Setting, variables, positions, spans) -> ShardedWeights | None:
    """ZeRO-3's slices of the stage's weights, cut as its update's segments (`positions`;
    None: one), or None where the strategy does not shard weights over replicas."""
    topology = setting.topology
    if not (setting.strategy.shard_weights and topology.num_replicas > 1):
        return None
    segments = sliced_segments(variables.all, variables.dense, positions, topology.stage_comm)
    weights = ShardedWeights(
        segments,
        variables.all,
        topology.stage_comm,
        setting.guard,
        span=spans.span,
        traffic=setting.traffic,
        keeps_slices=deferred.built_in_scope(setting.model),
    )
    # built under hf.scope(): what is not sliced (tables) is allocated whole here, before a
    # runner reads its variables
    deferred.materialize(v for v in variables.all if not weights.holds(v))
    return weights


def _gradient_facts(setting: Setting, variables, layout, shared_across_stages: bool) -> dict:
    """The facts `choose_gradient_form` decides the gradient form from."""
    strategy, sharded_layers, plan = setting.strategy, setting.sharded_layers, setting.plan
    # a split backward's weight gradients are final only after the step's last W, and
    # interleaved chunks end their backwards apart: neither is cut into segments; nor is a
    # stage whose router losses one runner tallies
    whole = strategy.schedule in ("zero_bubble", "interleaved") and plan is not None
    whole = whole or sharded_layers.tally is not None
    return dict(
        partitioned=plan is not None,
        replicas=setting.topology.num_replicas,
        backend=setting.comm_backend,
        flat_gradients=strategy.flat_gradients,
        dense_variables=len(variables.dense),
        all_float32=layout.usable,
        large_variables=layout.large_variables,
        shared_across_stages=shared_across_stages,
        tables=len(variables.sparse),
        rows_classified=setting.row_kinds.complete,
        segments=1
        if whole
        else segment_count(strategy, setting.model, variables.all, setting.topology.num_replicas),
        tensor_split=sharded_layers.tensor is not None,
        expert_split=sharded_layers.experts is not None,
        shard_gradients=strategy.shard_gradients and setting.topology.num_replicas > 1,
    )


def _build_gradient_parts(
    setting: Setting, variables, runner, form, shared, overlap, weights=None
) -> tuple:
    """(reduction across stages and replicas, the optimizer update, ZeRO-1's sharded update
    or None, the update by segment or None), as the gradient `form` asks; `weights`: ZeRO-3's
    `ShardedWeights`, whose slices the sharded update steps."""
    topology, sharded_layers, guard = setting.topology, setting.sharded_layers, setting.guard
    gradient_sync = GradientSync(
        topology,
        runner,
        variables.all,
        variables.dense,
        variables.sparse,
        backend=setting.comm_backend,
        shared=shared,
        overlap=overlap if form.overlap else None,
        experts=sharded_layers.experts,
        row_kinds=setting.row_kinds,
    )
    update = Update(
        setting.model,
        topology,
        variables.all,
        variables.owned,
        partitioned=setting.plan is not None,
        guard=guard,
        merge=gradient_sync.merge,
        layout=runner.layout,
        split=sharded_layers.tensor.variables if sharded_layers.tensor else (),
        expert_split=sharded_layers.expert_split(),
    )
    # ZeRO-1: the replicas split the optimizer state and its update
    # (engine/sharded_optimizer/sharded_update.py); by segment, each segment is
    # reduce-scattered, its slice updated, its parameters gathered as soon as the last
    # backward has finished it
    positions = (
        segment_positions(variables.all, overlap, leave_out=variables.sparse)
        if form.update_per_segment
        else None
    )
    sharded = None
    if setting.strategy.shard_optimizer and topology.num_replicas > 1:
        sharded = ShardedUpdate(
            setting.model,
            topology,
            variables.all,
            update,
            gradient_sync,
            segments=positions,
            sliced=None if weights is None else weights.segments,
            weights_sharded=weights is not None,
        )
    segment_update = None
    if form.update_per_segment:
        replicas = topology.stage_comm if topology.num_replicas > 1 else None
        segment_update = SegmentUpdate(
            update,
            runner,
            overlap,
            replicas=replicas,
            guard=guard,
            sharded=sharded,
            scatter_each_backward=sharded is not None and setting.strategy.shard_gradients,
            tables=variables.sparse,
        )
    return gradient_sync, update, sharded, segment_update


class Trainer:
    """Training, evaluation and prediction steps for this rank's (stage, replica).

    `plan` is None for data parallelism (the whole user model is the only stage, so any model
    works, subclassed ones included); otherwise the partitioner's `Plan`. Its parts
    (`TrainerParts`, built by `build_parts` from the arguments) are `parts`.
    """

    def __init__(self, model, strategy, comm, plan=None, **options):
        self.parts = parts = build_parts(model, strategy, comm, plan, **options)
        self.model, self.strategy, self.plan = model, strategy, plan
        self.topology = parts.setting.topology
        self.variables = parts.variables.all
        self.stage_state = parts.stage_state
        self.guard = parts.setting.guard
        self.sharded_layers = parts.setting.sharded_layers
        self.traffic = parts.setting.traffic  # the profiler reads it
        self.check_numerics = False
        weights = parts.sharded_weights
        self._any_added_losses = None  # whether any stage's layers add losses (agreed once)
        # Compiled like Keras's own step: metric updates and results are a call each.
        self._loss_tracker_fn = traced(
            lambda value, count: _keras.loss_tracker(model).update_state(value, sample_weight=count)
        )
        self._replica_metrics = ReplicaMetrics(model, self.topology.stage_comm)
        self._log_root = self.topology.grid.rank_of(self.topology.num_stages - 1, 0)
        if weights is not None:  # the slices start from the model's weights
            weights.load()
            weights.take_over()
        self.sharded_layers.take_over()  # the split wholes are let go while fit trains
        _keras.forget_compiled_steps(model)  # traced over the backings just replaced
        # graphs traced before (Keras's steps, the model checks' probes) are reference cycles
        # that hold the old backings' resources, the weights' first copy: free them now
        gc.collect()
        # Built under hf.scope(): weights of other stages were never allocated on this rank,
        # and under ZeRO-3 each replica keeps its slices after the fit too
        self.holds_share_only = (weights is not None and weights.keeps_slices) or any(
            deferred.is_deferred(v)
            for v in model.variables
            if weights is None or not weights.holds(v)
        )

    @property
    def shards_gradients(self) -> bool:
        """Whether this stage keeps only its slice of the gradients (ZeRO-2): cut into
        segments, each reduce-scattered as every backward makes it."""
        segment_update = self.parts.segment_update
        return segment_update is not None and segment_update.scatters

    @property
    def shards_weights(self) -> bool:
        """Whether this stage holds only its slice of the weights between steps (ZeRO-3)."""
        return self.parts.sharded_weights is not None

    def give_back_weights(self) -> None:
        """ZeRO-3: the model's variables get their values back, all-gathered from the slices
        (collective over the replicas; nothing where they hold them, or without ZeRO-3, or
        where a model built under hf.scope() keeps its slices); the next step lets them go
        again."""
        weights = self.parts.sharded_weights
        if weights is not None and not weights.keeps_slices:
            weights.restore()

    def give_back_weights_after_failure(self, clean) -> None:
        """After a step failed on every rank: the variables get their values back from ZeRO-3's
        slices, all-gathered over this stage's replicas, then from the tensor and expert
        shards, each over groups of the same ranks split out of `clean` (a duplicate of the
        fit's communicator that no failed step used: the stage's own may be left
        mid-collective). Collective over `clean`: every rank calls it (`give_back_after_failure`
        where a rank has no trainer)."""
        weights = self.parts.sharded_weights
        gather_back(clean, weights, self.topology.stage_comm)
        store_after_failure(clean, self.sharded_layers)

    @property
    def is_last(self) -> bool:
        return self.topology.is_last_stage

    @property
    def step(self) -> int:
        """Optimizer steps taken through this trainer (checkpoints save it)."""
        return self.stage_state.step

    @property
    def seed(self) -> int:
        """The shared shuffle seed of the current fit (checkpoints record it)."""
        return self.stage_state.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self.stage_state.seed = value

    def layers_active(self) -> contextlib.ExitStack:
        """The layers as this rank runs them: its tensor and expert shards, and keras_hub
        mixture blocks' experts dispatched sparsely (`ShardedLayers`)."""
        return self.sharded_layers.active()

    def load_shards(self) -> None:
        """Slice the model's current weights into this rank's tensor and expert shards (each
        fit, evaluate or predict starts from the model as the user holds it), and ZeRO-3's
        slices."""
        self.sharded_layers.load()
        weights = self.parts.sharded_weights
        if weights is not None and not weights.released:
            weights.load()

    def use_watchdog(self, timeout: float) -> None:
        """Guard blocking MPI waits with a `timeout`-second watchdog (0: none)."""
        self.guard.use(timeout)

    def attach_recorder(self, recorder: events.Recorder | None) -> None:
        """Record timed spans of each training step into `recorder` (None: record nothing)."""
        self.parts.spans.record_into(recorder)
        # each tensor collective, expert exchange or experts' compute, as it ends, is a span
        inner = (
            (self.sharded_layers.tensor, (collectives.TAG,), events.TENSOR),
            (self.sharded_layers.experts, expert_parallel.SPAN_TAGS, events.EXPERTS),
        )
        for split, tags, kind in inner:
            if split is not None:
                listener = None if recorder is None else events.span_listener(recorder, kind)
                self.traffic.listen(tags, listener)

    @property
    def recorder(self) -> events.Recorder | None:
        return self.parts.spans.recorder

    # --- steps ---------------------------------------------------------------------------
    def train_step(self, batch: GlobalBatch) -> None:
        """One optimizer step on one global batch (collective over every rank). ZeRO-3: the
        slices take the weights first where the variables hold them (the fit's first step,
        or after `sync_weights` gave them back for callbacks), which then let theirs go."""
        if self.parts.sharded_weights is not None:
            self.parts.sharded_weights.release()
        self.sharded_layers.release()  # the shards are the split weights until `sync_weights`
        with self.layers_active():
            self.optimizer_step(batch)

    def optimizer_step(self, batch: GlobalBatch) -> None:
        """One optimizer step on `batch`, the layers already active (`train_step`): the seam
        where a trainer of another kind of step plugs in (`CustomStepTrainer`)."""
        parts = self.parts
        microbatches = self._microbatches(batch, training=True)
        parts.output_losses.begin(batch.size)
        hooks = parts.gradient_path.begin(self.check_numerics)
        with parts.spans.step(batch.size, len(microbatches)):
            losses = parts.walk.run(
                microbatches,
                batch.size,
                train=True,
                loss_scale=parts.update.loss_scale(),
                on_segment_done=hooks.last,
                on_earlier_segment=hooks.earlier,
            )
            reg_value = parts.gradient_path.finish(losses, self.check_numerics)
        self._track_loss(losses, reg_value, self._added_total())
        self._end_step()

    def _end_step(self) -> None:
        """After each optimizer step: replicas' moving statistics averaged, the step counted."""
        self._average_moving_statistics()
        self.stage_state.step += 1
        self.guard.at_step(self.step)

    def eval_step(self, batch: GlobalBatch, reg_value: float) -> None:
        """Forward-only pass of one batch: loss and metrics accumulate at the last stage."""
        self.parts.output_losses.begin(batch.size)
        with self.layers_active():
            losses = self.parts.walk.run(self._microbatches(batch), batch.size, train=False)
            self._track_loss(losses, reg_value, self._added_total())

    def predict_step(self, batch: GlobalBatch) -> list | None:
        """Forward-only pass; the last stage returns its shard's outputs (micro-batch list)."""
        microbatches = self._microbatches(batch)
        with self.layers_active():
            return self.parts.walk.run(microbatches, batch.size, train=False, predict=True)

    def _microbatches(self, batch: GlobalBatch, training: bool = False) -> list:
        """This replica's micro-batches of `batch` (refused alike on every rank where one
        replica would get no rows while the others wait for it inside the step)."""
        self.sharded_layers.refuse_empty_replicas(batch.size, self.topology.num_replicas, training)
        return self.parts.walk.microbatches(batch)

    def regularization(self) -> float:
        """The model's total weight regularization (collective over the pipeline)."""
        return self.parts.update.regularization()

    def _added_total(self) -> float:
        """This step's added losses (`add_loss`, activity regularization) of this replica's
        pipeline, each micro-batch's weighted by its size (collective over the pipeline once
        any stage's layers add losses)."""
        added = self.parts.walk.take_added() + self.sharded_layers.take_router_losses()
        pipeline = self.topology.pipeline_comm
        if self._any_added_losses is None:  # known once every stage has traced its calls
            self._any_added_losses = self._agree_on_added_losses()
        if not self._any_added_losses:
            return 0.0
        local = sum(rows * float(value) for rows, value in added)
        with self.guard("sum added losses over the pipeline"):
            return pipeline.allreduce(local)

    def _agree_on_added_losses(self) -> bool:
        """Whether any stage's layers add losses (collective over the pipeline), after refusing
        (`strict_added_losses`) or warning about those that are not means over the batch:
        router losses and losses built from `hf.global_mean` are the global batch's."""
        layers = self.sharded_layers
        microbatches_per_batch = self.topology.num_replicas * self.strategy.microbatches
        exact = {block.name for block in layers.dispatch.blocks} | layers.batch.users
        inexact = self.parts.loss_adders - exact
        if self.strategy.strict_added_losses:
            with self.guard("agree on added losses"):
                refuse_unless_batch_means(inexact, microbatches_per_batch, self.topology.world)
        warn_unless_batch_means(inexact, microbatches_per_batch)
        adds = bool(self.parts.runner.has_added_losses)
        with self.guard("agree on added losses"):
            return bool(self.topology.pipeline_comm.allreduce(adds, op=mpi_op("LOR")))

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
        variables = self.parts.moving_statistics
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

    def sliced_optimizers(self) -> list:
        """(optimizer, `SliceCheckpoint`) of each optimizer but the compiled one whose state
        this replica holds slices of: none under the engine's own step
        (`CustomStepTrainer`'s model may apply several)."""
        return []

    def finalize_variables(self) -> None:
        """What Keras's fit does once training ends: the optimizer's last word on the variables
        (with `use_ema=True`, their moving averages), on each stage's own variables."""
        optimizer = self.model.optimizer
        if self.variables and getattr(optimizer, "built", False):
            optimizer.finalize_variable_values(self.variables)

    def sync_weights(self) -> None:
        """Give every rank the full model: each stage broadcasts the weights it owns. A model
        built under hf.scope() stays where it is: each rank keeps its own share. ZeRO-3's
        slices are all-gathered back into the variables."""
        self.give_back_weights()
        self.sharded_layers.store(self.guard)  # first put split weights together
        if self.plan is None or self.holds_share_only:
            return  # replicas stay identical: every one applies the same reduced gradients
        broadcast_owned_weights(self.model, self.plan, self.topology.pipeline_comm, self.guard)

    def close(self) -> None:
        self.guard.close()
        self.parts.walk.close()
        if self.parts.sharded_weights is not None:
            self.parts.sharded_weights.close()
        self.sharded_layers.free()
        self.topology.free()


def gather_back(clean, weights, replicas) -> None:
    """`weights.restore` over the replica group of `replicas` split out of `clean`, if every
    rank of `clean` holds released slices (`weights` None: this rank holds none); collective
    over `clean`."""
    held = int(weights is not None and weights.released)
    if not clean.allreduce(held, op=mpi_op("MIN")):
        return
    group = same_ranks(clean, replicas)
    try:
        weights.restore(over=group)
    finally:
        group.Free()


def give_back_after_failure(clean) -> None:
    """`Trainer.give_back_weights_after_failure` on a rank that holds no trainer: it joins the
    others' collectives over `clean` and gives nothing."""
    gather_back(clean, None, None)
    store_after_failure(clean, None)
