"""`memory_plan`: every rank's predicted bytes for a model, strategy and batch size."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import keras
import numpy as np

from hyparflow import _keras, deferred
from hyparflow.comm.topology import Grid
from hyparflow.memory import buffers, counts
from hyparflow.memory.slots import optimizer_slots
from hyparflow.memory.table import MemoryPlan, RankMemory
from hyparflow.moe import expert_weights
from hyparflow.own_steps import own_steps
from hyparflow.partitioner import partition
from hyparflow.partitioner.graph import build_graph, numpy_dtype
from hyparflow.schedule import make_schedule
from hyparflow.strategy import make_strategy
from hyparflow.tensor import rules as tensor_rules
from hyparflow.tensor.splits import COLUMN

# TensorFlow's own resident growth over a first training epoch on a CPU (kernel registries,
# thread pools, traced and optimised graphs), measured with a 98-parameter MLP: 32 MiB for
# Keras in one process, 25-29 MiB on a rank of the engine (docs/memory.md, "The runtime
# constant"; benchmarks/memory.py measures it again).
RUNTIME_BYTES = 30 * 2**20


def memory_plan(
    model,
    strategy="auto",
    batch_size: int = 32,
    *,
    num_partitions=None,
    num_replicas=None,
    num_microbatches=None,
    whole_model: bool | None = None,
    runtime: bool = True,
    splits: dict | None = None,
    every_replica: bool = True,
) -> MemoryPlan:
    """Predict the peak bytes of every rank when `hf.fit(model, ..., strategy=strategy)`
    trains `model` with global batches of `batch_size` (docs/memory.md).

    `strategy`: an `hf.Strategy` or the names `hf.fit` takes, resolved for the world size
    `partitions x replicas x tensor`. The model should be compiled (its optimizer's slots are
    counted; an uncompiled model counts none). `whole_model=True` (a model built outside
    `hf.scope`) adds the user's whole model, which every rank then holds besides its stage,
    and the epoch end's exchange of every stage's weights; `False` (a `hf.scope()` model,
    detected when None) counts only what the rank materialises. `runtime=False` leaves out
    TensorFlow's own measured constant. `splits`: a dict the caller keeps across the plans of
    one model (the planner's hundreds of layouts), so that each stage split, its tensor
    layouts and the variables' sizes are made once. `every_replica=False` lists replicas 0
    and 1 only (ranks are replica-major): every later replica's bytes equal replica 1's,
    since only the first replica writes the optimizer state at a save, so `largest` is the
    same (the planner's).

    For example:
        plan = hf.memory_plan(model, hf.Strategy("model", partitions=4), batch_size=64)
        plan.summary()
        plan.largest.total / 2**30  # GiB on the fullest rank
    """
    if whole_model is None:
        whole_model = not deferred.any_deferred(model)
    strategy = make_strategy(strategy, num_partitions, num_replicas, num_microbatches)
    world = (strategy.partitions or 1) * (strategy.replicas or 1) * strategy.tensor
    resolved = strategy.resolve(world)
    notes = []
    shared = _shared_facts(model, resolved, world, batch_size, whole_model, notes, splits)
    grid = Grid(resolved.partitions, resolved.replicas, resolved.tensor)
    shown = world if every_replica else min(world, 2 * grid.partitions * grid.tensor)
    ranks = [
        _rank_memory(shared, rank, *grid.coords3(rank), runtime=runtime) for rank in range(shown)
    ]
    return MemoryPlan(model.name, _label(resolved), batch_size, ranks, notes)


@dataclass(frozen=True)
class _Shared:
    """What every rank's prediction reads: the resolved strategy and each stage's facts."""

    resolved: object
    world: int
    whole_model: bool
    by_segment: bool
    cuttable: bool  # a layer graph, which segments can cut (else one segment)
    subclassed: bool  # no layer graph and no step of its own: ZeRO-3 gathers it layer by layer
    stage_models: list
    per_sample: list  # per stage: layout -> (layer output bytes, received input bytes)
    layouts: list  # per stage: its tensor layout, or None without tensor parallelism
    experts: frozenset  # ids of the expert kernels split over `resolved.experts` replicas
    tables: frozenset  # ids of embedding tables (kept whole by ZeRO)
    slots: float
    owned: list[int]
    largest: list[int]
    whole: int
    samples: int
    saving: Callable[[int, int, int], dict[str, int]]
    split: dict  # id(layout) -> ids of the variables it splits (every rank reads them)
    sizes: dict  # id(variable) -> (elements, bytes per element), read once per plan

    def nbytes(self, variable, itemsize: int | None = None) -> int:
        """`_nbytes(variable, itemsize)` of a model variable, from `sizes`."""
        return _nbytes(variable, itemsize, self.sizes)

    def parts(self, variable, layout) -> int:
        """How many ranks split `variable`: the tensor ranks where `layout` (a stage's tensor
        layout) splits it, the expert group for an expert kernel, else 1."""
        if layout is not None and id(variable) in self.split[id(layout)]:
            return self.resolved.tensor
        return self.resolved.experts if id(variable) in self.experts else 1

    def held_by(self, stage: int) -> list[int]:
        """The model chunks pipeline stage `stage` holds: itself, or (interleaved) the chunks
        `stage`, `stage + P`, ... of `stage_models`."""
        return list(range(stage, len(self.stage_models), self.resolved.partitions))


def _shared_facts(model, resolved, world, batch_size, whole_model, notes, splits) -> _Shared:
    """The model-wide facts of the plan, computed once for all ranks."""
    stage_models, per_sample, layouts = _split(model, resolved, notes, splits)
    # a model's own step differentiates the whole model with its own tape: one segment
    cuttable = per_sample is not _UNCUT and not own_steps(model)
    sizes = _kept(splits, "sizes", lambda: {id(v): _size(v) for v in model.weights})
    nbytes = functools.partial(_nbytes, sizes=sizes)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        notes.append("the model is not compiled: no optimizer state counted")
    slots = optimizer_slots(optimizer)
    asked = resolved.update_by_segment  # None: on for a hf.scope() model, as the engine does
    return _Shared(
        resolved=resolved,
        world=world,
        whole_model=whole_model,
        by_segment=(not whole_model) if asked is None else asked,
        cuttable=cuttable,
        subclassed=per_sample is _UNCUT and not own_steps(model),
        stage_models=stage_models,
        per_sample=per_sample,
        layouts=layouts,
        experts=frozenset(map(id, expert_weights(model)))
        if getattr(resolved, "experts", 1) > 1
        else frozenset(),
        tables=_kept(splits, "tables", lambda: _tables(model)),
        slots=slots,
        owned=_owned_bytes(stage_models, nbytes),
        largest=[max((nbytes(v) for v in m.weights), default=0) for m in stage_models],
        whole=sum(map(nbytes, model.weights)),
        samples=counts.microbatch_size(batch_size, resolved.replicas, resolved.microbatches),
        saving=_saving(model, slots, resolved, world),
        split={id(lay): {key for s in lay.splits for key in s.axes} for lay in layouts if lay},
        sizes=sizes,
    )


def _kept(splits: dict | None, key: str, make):
    """`make()`, kept in `splits` under `key` (made once across the plans that share it)."""
    if splits is None:
        return make()
    if key not in splits:
        splits[key] = make()
    return splits[key]


def _rank_memory(shared: _Shared, rank, stage, replica, shard, *, runtime: bool) -> RankMemory:
    """One rank's predicted bytes, by kind."""
    resolved = shared.resolved
    held = shared.held_by(stage)
    models = [shared.stage_models[c] for c in held]
    layout, stage_model = shared.layouts[stage], models[0]  # tensor ranks: one chunk a stage
    sharded = getattr(resolved, "shard_optimizer", False)
    weights = _each_once([v for m in models for v in m.weights])  # a layer two chunks call
    unsplit = sum(shared.nbytes(v) for v in weights if shared.parts(v, layout) == 1)
    trainable = _each_once([v for m in models for v in m.trainable_variables])
    grad_bytes = sum(shared.nbytes(v) // shared.parts(v, layout) for v in trainable)
    # ZeRO-1 slices the slots over the replicas; expert shards keep theirs whole (1/E)
    experts = [v for v in trainable if id(v) in shared.experts]
    expert_bytes = sum(shared.nbytes(v) // resolved.experts for v in experts)
    own_optimizer = counts.optimizer_bytes(
        grad_bytes - expert_bytes, shared.slots, resolved.replicas, sharded
    ) + counts.optimizer_bytes(expert_bytes, shared.slots)
    facts = _stage_facts(shared, trainable, layout)
    held_weights = sum(shared.nbytes(v) // shared.parts(v, layout) for v in weights)
    if _slices_weights(resolved) and not shared.whole_model:
        # ZeRO-3 under hf.scope(): each rank allocates its slices of the dense weights
        dense = sum(
            shared.nbytes(v) // shared.parts(v, layout)
            for v in trainable
            if id(v) not in shared.tables and id(v) not in shared.experts
        )
        held_weights -= dense - -(-dense // resolved.replicas)  # kept sliced after the fit too
    return RankMemory(
        rank=rank,
        stage=stage,
        replica=replica,
        shard=shard,
        weights=held_weights,
        model_copy=shared.whole - unsplit if shared.whole_model else 0,
        optimizer=own_optimizer,
        gradients=buffers.held_gradients(facts, grad_bytes),
        activations=_activations(shared, stage, held, layout),
        step_buffers=buffers.step_buffers(facts, shared.slots, sharded),
        exchange={
            **buffers.exchange_buffers(shared.owned, stage, max(shared.largest[c] for c in held)),
            **buffers.gather_buffers(_largest_split(shared, stage_model, layout)),
            **shared.saving(rank, replica, own_optimizer),
        }
        if shared.whole_model
        else {},  # a hf.scope() model keeps its stage (under ZeRO-3, its slices)
        runtime=RUNTIME_BYTES if runtime else 0,
    )


def _activations(shared: _Shared, stage: int, held: list[int], layout) -> int:
    """Activation bytes at the stage's peak: its micro-batches in flight, by the schedule, per
    chunk it holds."""
    resolved = shared.resolved
    per_chunk = [shared.per_sample[c](layout) for c in held]
    if len(held) > 1:
        actions = make_schedule(
            "interleaved", resolved.partitions, resolved.microbatches, len(held)
        )[stage]
        return counts.chunk_activation_bytes(actions, per_chunk, shared.samples, resolved.recompute)
    flight = counts.in_flight(resolved.schedule, resolved.partitions, resolved.microbatches, stage)
    return counts.activation_bytes(*per_chunk[0], shared.samples, flight, resolved.recompute)


def _slices_weights(resolved) -> bool:
    """Whether the replicas hold slices of the weights (ZeRO-3)."""
    return getattr(resolved, "shard_weights", False) and resolved.replicas > 1


def _tables(model) -> frozenset:
    """Ids of the model's embedding tables, which ZeRO keeps whole."""
    return frozenset(
        id(_keras.table_variable(layer))
        for layer in _keras.all_layers(model)
        if _keras.has_table_variable(layer)
    )


def _each_once(variables: list) -> list:
    return list({id(v): v for v in variables}.values())


def _stage_facts(shared: _Shared, trainable, layout) -> buffers.StageFacts:
    """The facts the step's gradient and update buffers depend on, for one rank's stage."""
    resolved, t = shared.resolved, shared.resolved.tensor
    float32 = [shared.nbytes(v, itemsize=4) // shared.parts(v, layout) for v in trainable]
    return buffers.StageFacts(
        gradient_bytes=sum(float32),
        variables=len(trainable),
        stages=resolved.partitions,
        replicas=resolved.replicas,
        microbatches=resolved.microbatches,
        world=shared.world,
        flat_gradients=resolved.flat_gradients,
        largest=max(float32, default=0),
        tensor=t,
        by_segment=shared.by_segment,
        cuttable=shared.cuttable,
        by_layer=shared.subclassed
        and resolved.partitions == 1
        and t == 1
        and _slices_weights(resolved),
        shard_optimizer=getattr(resolved, "shard_optimizer", False),
        shard_gradients=getattr(resolved, "shard_gradients", False),
        shard_weights=getattr(resolved, "shard_weights", False),
    )


def _label(resolved) -> str:
    """The plan's one-line description of the layout."""
    label = (
        f"P={resolved.partitions} x R={resolved.replicas} x T={resolved.tensor}, "
        f"{_schedule(resolved)}, M={resolved.microbatches}"
    )
    if resolved.recompute:
        label += ", recompute"
    if getattr(resolved, "shard_weights", False):
        label += ", sharded optimizer, gradients and weights"
    elif getattr(resolved, "shard_gradients", False):
        label += ", sharded optimizer and gradients"
    elif getattr(resolved, "shard_optimizer", False):
        label += ", sharded optimizer"
    if getattr(resolved, "experts", 1) > 1:
        label += f", experts over {resolved.experts} replicas"
    return label


def _schedule(resolved) -> str:
    interleaved = resolved.schedule == "interleaved" and resolved.partitions > 1
    return f"interleaved (v={resolved.virtual_stages})" if interleaved else resolved.schedule


# The activations of a model that is not a layer graph: not counted, and it cannot be cut into
# segments (`buffers.segments`)
_UNCUT = [lambda layout: (0, 0)]


def _split(model, resolved, notes, splits: dict | None) -> tuple[list, list, list]:
    """Each stage's model, activation bytes (`_stages`) and tensor layout, from `splits` (a
    caller's dict) where an earlier plan made them; its notes are said again."""
    chunks = resolved.virtual_stages if resolved.schedule == "interleaved" else 1
    t = resolved.tensor
    key = (resolved.partitions, chunks, t, repr(resolved.balance), repr(resolved.tensor_layout))
    splits = {} if splits is None else splits
    if key not in splits:
        said = []
        stage_models, per_sample = _stages(model, resolved, said)
        layouts = [
            tensor_rules.tensor_layout(m, t, resolved.tensor_layout) if t > 1 else None
            for m in stage_models
        ]
        splits[key] = (stage_models, per_sample, layouts, said)
    *made, said = splits[key]
    notes += said
    return tuple(made)


def _stages(model, strategy, notes) -> tuple[list, list]:
    """Each stage's Keras model (each model chunk's, interleaved) and a function giving its
    activation bytes per sample (layer outputs, received inputs) under a tensor layout."""
    if strategy.partitions == 1:
        try:
            graph = build_graph(model)
        except ValueError:
            notes.append("not a graph of layers: activations not counted")
            return [model], _UNCUT
        nodes = graph.nodes
        inputs = sum(graph.tensors[i].bytes_per_sample for i in graph.inputs)
        return [model], [lambda layout: (_outputs(graph, nodes, layout), inputs)]
    uncut = tensor_rules.pair_cuts if strategy.tensor > 1 else None
    chunks = strategy.virtual_stages if strategy.schedule == "interleaved" else 1
    plan = partition(model, strategy.partitions * chunks, strategy.balance, uncut=uncut)
    graph = plan.graph
    by_name = {node.name: node for node in graph.nodes}
    per_sample = []
    for stage in plan.stages:
        nodes = [by_name[name] for name in stage.nodes]
        received = stage.bytes_received_per_sample
        per_sample.append(lambda layout, n=nodes, b=received: (_outputs(graph, n, layout), b))
    return [stage.model for stage in plan.stages], per_sample


def _saving(model, slots: float, strategy, world: int):
    """What each rank copies out after a split fit of an ordinary build so that rank 0's saved
    files carry the whole optimizer state: `sent(rank, own_optimizer_bytes)` -> named bytes.
    Plain data parallelism needs none (every replica holds the whole state)."""
    sharded = bool(getattr(strategy, "shard_optimizer", False))
    split = strategy.partitions * strategy.tensor > 1 or sharded
    trainable = [_nbytes(v) for v in model.trainable_variables]
    whole = counts.optimizer_bytes(sum(trainable), slots)  # a group is at most all of it
    group = int(min(max(max(trainable, default=0) * slots, buffers.BUCKET_BYTES), whole))

    def sent(rank: int, replica: int, own: int) -> dict[str, int]:
        if world == 1 or not split:
            return {}
        writes = own if replica == 0 or sharded else 0  # the first replica writes the slots
        return buffers.saving_buffers(writes, group, root=rank == 0)

    return sent


def _outputs(graph, nodes, layout) -> int:
    """Bytes per sample of the outputs of `nodes`; a column-split layer's output is a shard."""
    columns = set()
    if layout is not None:
        columns = {id(s.layer) for s in layout.splits if s.role == COLUMN}
    total = 0
    for node in nodes:
        size = sum(graph.tensors[i].bytes_per_sample for i in node.outputs)
        total += size // layout.parts if id(node.operation) in columns else size
    return total


def _owned_bytes(stage_models, nbytes=None) -> list[int]:
    """Bytes of the weights each stage owns (first uses), which it broadcasts at an epoch's
    end; `nbytes(variable)` gives a variable's (default `_nbytes`)."""
    seen, owned = set(), []
    for m in stage_models:
        mine = [v for v in m.weights if id(v) not in seen]
        seen.update(id(v) for v in mine)
        owned.append(sum(map(nbytes or _nbytes, mine)))
    return owned


def _largest_split(shared: _Shared, stage_model, layout) -> int:
    """Bytes of the largest piece of the stage's variables split over tensor ranks or an
    expert group (0: none)."""
    pieces = [
        shared.nbytes(v) // shared.parts(v, layout)
        for v in stage_model.weights
        if shared.parts(v, layout) > 1
    ]
    return max(pieces, default=0)


def _nbytes(variable, itemsize: int | None = None, sizes: dict | None = None) -> int:
    """Bytes of `variable` (at `itemsize` bytes an element if given), its size read from
    `sizes` (id -> `_size`) where that holds it."""
    elements, own = (sizes or {}).get(id(variable)) or _size(variable)
    return elements * (own if itemsize is None else itemsize)


def _size(variable) -> tuple[int, int]:
    """(elements, bytes per element) of `variable`."""
    dtype = numpy_dtype(keras.backend.standardize_dtype(variable.dtype))
    return int(np.prod(variable.shape, dtype=np.int64)), np.dtype(dtype).itemsize
