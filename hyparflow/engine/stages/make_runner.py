"""Building a stage's runner in its gradient form: fused, pipelined or cut into segments."""

from __future__ import annotations

import dataclasses

import keras

from hyparflow import _keras
from hyparflow.checkpoint.state import layers_of_seed_keys, seed_generators
from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.engine.gradients.flat import BucketedLayout
from hyparflow.engine.keras_semantics.added_losses import added_loss
from hyparflow.engine.keras_semantics.sync_batchnorm import TAG as BATCHNORM_TAG
from hyparflow.engine.keras_semantics.sync_batchnorm import (
    synchronized_batchnorm,
    synchronized_layers,
)
from hyparflow.engine.relaxed import declared_shapes
from hyparflow.engine.stages.chunks import ChunkRunners
from hyparflow.engine.stages.fused import FusedRunner
from hyparflow.engine.stages.segments import SegmentedRunner
from hyparflow.engine.stages.split_stage import SplitStageRunner
from hyparflow.engine.stages.stage import StageRunner
from hyparflow.engine.stages.structure import pack_model_outputs
from hyparflow.partitioner import partition


class RunnerParts:
    """What every runner of one rank's stage is built from.

    `call(inputs, training)` computes the stage, `loss` and `metrics` are the compiled loss and
    metric update (used at the last stage), `loss_adders` collects the layers that call
    `add_loss` while tracing. `stage` is the partitioner's stage (None: the whole model).
    `tally`: the mixture blocks' `RouterTally` (None: their router losses, if any, are added
    in each forward). `row_kinds`: the model's row-sparse variables (`sparse.RowKinds`).
    `traffic`: the trainer's `TrafficLog`, where synchronised BatchNormalization counts its sums.
    """

    def __init__(
        self,
        model,
        stage,
        topology,
        strategy,
        *,
        call,
        loss,
        metrics,
        loss_adders,
        traffic,
        tally=None,
        row_kinds=row_sparse.UNPROBED,
    ):
        self.model, self.stage, self.topology, self.strategy = model, stage, topology, strategy
        self.call, self.loss, self.metrics, self.loss_adders = call, loss, metrics, loss_adders
        self.tally, self.traffic = tally, traffic
        self.row_kinds = row_kinds
        # the model's first and last stage (not the rank's: interleaved ranks run several)
        count = 1 if stage is None else topology.num_stages * strategy.virtual_stages
        self.is_first = stage is None or stage.index == 0
        self.is_last = stage is None or stage.index == count - 1
        self.graph = model if stage is None else stage.model

    def batchnorm_scope(self, layers):
        """The context that sums BatchNormalization statistics of `layers` across replicas
        (those that want the global batch's: `synchronized=True`, or all with the strategy's
        `sync_batchnorm`); None when there is nothing to sum."""
        synced = synchronized_layers(layers, self.strategy.sync_batchnorm)
        if not synced or self.topology.num_replicas == 1:
            return None
        comm, traffic = self.topology.stage_comm, self.traffic.of(BATCHNORM_TAG)
        return lambda: synchronized_batchnorm(comm, traffic, synced)

    def added_losses(self, layers):
        return lambda: added_loss(layers, self.loss_adders)

    def forward_state(self, graph) -> list:
        """Variables a forward pass of `graph` changes: statistics and random seed states."""
        return list(graph.non_trainable_variables) + seed_variables(self.model, graph)


def build_runner(parts: RunnerParts, variables, sparse, form, layout, weights=None, gathering=None):
    """The stage's `FusedRunner` (whole model), `StageRunner` or, under the zero-bubble
    schedule, `SplitStageRunner`, gradients in `form` (`GradientForm`; `layout` the
    `FlatLayout` of the dense variables when `form.flat`). `weights` (ZeRO-3, a
    `ShardedWeights`): a `StageRunner` that gathers its other variables from it for every
    call and recomputes its forward in the backward (but where the backward comes right after
    it: `reuse_forward`), its gradients a list; or, with `gathering` (its `LayerGathering`),
    one whose layers gather their own weights inside its graph, its gradients slices."""
    layers = _keras.all_layers(parts.graph)
    strategy = parts.strategy
    whole = parts.model if parts.stage is None else None
    common = dict(
        sparse=sparse,
        row_kinds=parts.row_kinds,
        added_losses=parts.added_losses(layers),
        input_shapes=declared_shapes(whole, parts.stage),
        train_scope=parts.batchnorm_scope(layers),
    )
    if gathering is not None:
        return StageRunner(
            parts.call,
            variables,
            loss=parts.loss if parts.is_last else None,
            metrics=parts.metrics if parts.is_last else None,
            input_grads=not parts.is_first,
            layer_gathering=gathering,
            **common,
        )
    if weights is not None:
        tables = {id(variables[i]) for i in sparse}
        return StageRunner(
            parts.call,
            variables,
            loss=parts.loss if parts.is_last else None,
            recompute=True,
            state_variables=parts.forward_state(parts.graph),
            input_grads=not parts.is_first,
            tally=parts.tally,
            gather=weights.gather_for([v for v in variables if id(v) not in tables]),
            reuse_forward=True,
            **common,
        )
    if parts.stage is None and parts.tally is None:
        # nothing lives between forward and backward: one compiled call
        # Chunks, not one tensor: the step then never holds its gradients twice (flat.py).
        return FusedRunner(
            parts.call,
            variables,
            loss=parts.loss,
            metrics=parts.metrics,
            layout=BucketedLayout(layout.slots) if form.flat else None,
            microbatches=strategy.microbatches,
            **common,
        )
    options = dict(
        loss=parts.loss if parts.is_last else None,
        recompute=strategy.recompute,
        state_variables=parts.forward_state(parts.graph) if strategy.recompute else (),
        metrics=parts.metrics if parts.is_last else None,
        input_grads=not parts.is_first,
        layout=layout if form.flat else None,
        **common,
    )
    if strategy.schedule == "zero_bubble":  # the backward's weight half runs apart
        return SplitStageRunner(parts.call, variables, layers=layers, **options)
    return StageRunner(
        parts.call, variables, flat_backward=form.flat_backward, tally=parts.tally, **options
    )


def build_chunk_runners(parts: list[RunnerParts], variables, sparse, form, layout):
    """Interleaved 1F1B: a `StageRunner` per chunk of `parts`, each keeping lists, and the
    `ChunkRunners` that sums them into the rank's `variables` (flat only to be reduced, with
    `layout`, when `form.flat`)."""
    listed = dataclasses.replace(form, flat=False, flat_backward=False)
    runners = []
    for part in parts:
        chunk_variables = list(part.graph.trainable_variables)
        layers = _keras.all_layers(part.graph)
        tables = row_sparse.row_sparse_positions(chunk_variables, layers, part.row_kinds)
        runners.append(build_runner(part, chunk_variables, tables, listed, None))
    return ChunkRunners(runners, variables, sparse, layout if form.flat else None)


def cut_stage(parts: RunnerParts, segments: int):
    """The stage's sub-plan of up to `segments` contiguous segments (the partitioner's, balanced
    by parameters), or None when it cannot be cut (e.g. a subclassed model or too few
    layers)."""
    for count in range(segments, 1, -1):
        try:
            return partition(parts.graph, count, balance="params")
        except ValueError:
            continue
    return None


def build_segmented_runner(parts: RunnerParts, variables, sub, sparse=(), weights=None):
    """The stage as the segments of `sub` (`cut_stage`), so reductions overlap the backward:
    a `SegmentedRunner`. `sparse`: the positions of `variables` that are embedding tables,
    whose row slices each segment keeps. `weights` (ZeRO-3, a `ShardedWeights`): each segment
    gathers its other variables from it for every call, and recomputes its forward in the
    backward, but the last segment's, whose backward comes right after it (`reuse_forward`)."""
    tables = {id(variables[i]) for i in sparse}
    last = len(sub.stages) - 1
    strategy = parts.strategy
    recompute = strategy.recompute or weights is not None
    runners = []
    for j, segment in enumerate(sub.stages):
        packs = j == last and parts.is_last
        layers = _keras.all_layers(segment.model, include_self=False)
        own = segment.model.trainable_variables

        def call(inputs, training, segment=segment, packs=packs):
            flat = segment.forward(inputs, training=training)
            return pack_model_outputs(parts.model, flat) if packs else flat

        runners.append(
            StageRunner(
                call,
                own,
                loss=parts.loss if packs else None,
                recompute=recompute,
                state_variables=(parts.forward_state(segment.model) if recompute else ()),
                input_grads=j > 0 or not parts.is_first,
                added_losses=parts.added_losses(layers),
                input_shapes=declared_shapes(None, segment),
                train_scope=parts.batchnorm_scope(layers),
                sparse=[i for i, v in enumerate(own) if id(v) in tables],
                row_kinds=parts.row_kinds,
                gather=None
                if weights is None
                else weights.gather_for([v for v in own if id(v) not in tables]),
                # ZeRO-3: the last segment's backward follows its forward at once
                reuse_forward=weights is not None and j == last,
            )
        )
    per_batch = row_sparse.per_batch_flags(variables, sorted(sparse), parts.row_kinds)
    return SegmentedRunner(runners, variables, sparse, per_batch)


def seed_variables(model, graph) -> list:
    """The state variables of the seed generators of `graph`'s layers (part of `model`)."""
    layers = {id(layer) for layer in _keras.all_layers(graph)}
    owners = layers_of_seed_keys(model)
    return [var for key, var in seed_generators(model) if id(owners[key]) in layers]


def unsynchronized_moving_statistics(layers, sync_batchnorm: bool) -> list:
    """Moving mean and variance of the BatchNormalization layers that normalise alone."""
    synced = {id(layer) for layer in synchronized_layers(layers, sync_batchnorm)}
    return [
        v
        for layer in layers
        if isinstance(layer, keras.layers.BatchNormalization) and id(layer) not in synced
        for v in (layer.moving_mean, layer.moving_variance)
    ]
