"""Rank 0 collects the whole optimizer state after a split fit, so the files it saves hold it.

Each stage's optimizer holds the slots of the variables it updates: its own stage's, its
tensor pieces (joined along their axis, as the weights are), its ZeRO slices (joined into
whole slots). Every rank sends its entries, keyed as its checkpoint file keys them, to rank 0
in groups of `BROADCAST_GROUP_BYTES`; rank 0 writes them to its disk as they arrive
(checkpoint/spill.py), so no rank holds the whole optimizer state in memory at the end of a
fit. At the first save the model's optimizer reads them back, joined, into an optimizer built
for the whole model, and writes that into `model.save` and friends
(checkpoint/optimizer_file.py). Data parallelism without ZeRO needs nothing: each replica's
optimizer is already the whole one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from keras import callbacks as keras_callbacks

from hyparflow.checkpoint.optimizer_file import drop_whole_state, save_whole_state
from hyparflow.checkpoint.spill import Spill
from hyparflow.checkpoint.state import join_shards, optimizer_slots, written_pieces
from hyparflow.engine.custom_step import optimizers_of
from hyparflow.engine.weights import byte_groups, nbytes, numpy_dtype

_TAG = 3939  # point-to-point tag of the entries on the world communicator


def needs_gathering(trainer) -> bool:
    """Whether this layout leaves a partial optimizer on rank 0 (the same on every rank). A
    model built under hf.scope() keeps each rank's share (weights are not gathered either)."""
    split = trainer.plan is not None or trainer.parts.sharded_update is not None
    split = (
        split
        or trainer.sharded_layers.tensor is not None
        or trainer.sharded_layers.experts is not None
    )
    return split and not trainer.holds_share_only and trainer.topology.world.Get_size() > 1


def local_entries(stage) -> dict:
    """This rank's share of the optimizer state, as its checkpoint file holds it: arrays, or
    the optimizer's variables themselves, read one at a time as they are sent (`_array`)."""
    model, sharded = stage.model, stage.optimizer_shard
    if not stage.variables or not model.optimizer.built:
        return {}
    if sharded is not None:  # ZeRO-1: every replica holds slices
        return sharded.optimizer_state(model, stage.split, stage.shard, stage.replica)
    if not stage.writes_pieces:  # the same as replica 0's (or its expert group's)
        return {}
    slots = optimizer_slots(
        model, model.optimizer, written_pieces(stage.split, stage.shard, stage.replica)
    )  # the pieces it does not write keyed whole, which only the first rank keeps
    first = stage.shard == 0 and stage.replica == 0
    return {k: v for k, v in slots.items() if first or "@" in k}


def saves_files(trainer, callbacks) -> bool:
    """Whether any of the user's `callbacks` may save the model at an epoch's end (Keras's
    checkpoints, callbacks that run on rank 0 only), agreed by every rank."""
    kinds = (keras_callbacks.ModelCheckpoint, keras_callbacks.BackupAndRestore)
    return trainer.agree_any(
        any(isinstance(cb, kinds) or getattr(cb, "rank_zero_only", False) for cb in callbacks or [])
    )


class OptimizerGather:
    """Rank 0's whole optimizer state for the files a fit saves, gathered from `trainer`'s
    ranks at most once a step: the compiled optimizer's, and each other optimizer a model's
    own step steps by slices (`CustomStepTrainer.sliced_optimizers`). Made at the start of a
    fit, it first forgets the state an earlier fit gathered (training is about to change the
    optimizers)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.gathered_at = None  # the trainer's step at the last gather
        for optimizer in optimizers_of(trainer.model):
            drop_whole_state(optimizer)

    def gather(self) -> None:
        """Collective over every rank: rank 0's saved files get the whole optimizer state
        (until the next step). Costs one message of every rank's optimizer state to rank 0,
        once a step at most."""
        trainer = self.trainer
        if not needs_gathering(trainer) or self.gathered_at == trainer.step:
            return
        self.gathered_at = trainer.step
        stage = trainer.stage_state
        built_for = getattr(stage.optimizer_shard, "built_for", None)
        self._keep(trainer.model.optimizer, local_entries(stage), built_for)
        for optimizer, part in trainer.sliced_optimizers():
            entries = part.optimizer_state(trainer.model, stage.split, stage.shard, stage.replica)
            self._keep(optimizer, entries, part.built_for)

    def _keep(self, optimizer, entries: dict, built_for) -> None:
        """Every rank's `entries` of `optimizer`'s state on rank 0's disk, which rank 0's
        `optimizer` writes whole into saved files (built for `built_for`; None: the model's
        trainable variables)."""
        trainer = self.trainer
        spill = _gather(entries, trainer.topology.world, trainer.guard)
        if spill is None or not spill.nbytes:  # not rank 0, or an optimizer never built
            return
        drop_whole_state(optimizer)  # the last one goes before the new one is kept

        def read_state() -> dict:  # at the first save; the spill's file lives until then
            return join_shards(spill.arrays())

        save_whole_state(optimizer, trainer.model, read_state, built_for)


def _gather(entries: dict, comm, guard) -> Spill | None:
    """Every rank's `entries` in a `Spill` on rank 0's disk (None elsewhere): their keys,
    shapes and dtypes in one small gather, then the raw bytes, group by group, each written as
    it arrives (equal entries from several ranks, the step counter, are read back once)."""
    keys = list(entries)
    specs = [(k, tuple(entries[k].shape), np.dtype(numpy_dtype(entries[k])).str) for k in keys]
    with guard("gather optimizer state", peer=0):
        specs = comm.gather(specs, root=0)
    if comm.Get_rank() != 0:  # each group's values read as it goes: one group's copy at a time
        for group in byte_groups([entries[k] for k in keys]):
            flat = np.concatenate([_array(a).reshape(-1).view(np.uint8) for a in group])
            with guard("send optimizer state", peer=0):
                comm.Send(flat, dest=0, tag=_TAG)
        return None
    spill = Spill()
    for key in keys:
        spill.write(key, _array(entries.pop(key)))
    for source, spec in enumerate(specs[1:], start=1):
        _receive(spill, spec, source, comm, guard)
    return spill


def _receive(spill: Spill, spec: list, source: int, comm, guard) -> None:
    """Rank `source`'s entries (`spec`: key, shape, dtype each), in the sender's groups, into
    `spill`."""
    shapes = [_Shape(key, tuple(shape), np.dtype(dtype)) for key, shape, dtype in spec]
    for group in byte_groups(shapes):
        flat = np.empty(sum(nbytes(a) for a in group), np.uint8)
        with guard("receive optimizer state", peer=source):
            comm.Recv(flat, source=source, tag=_TAG)
        offset = 0
        for a in group:
            size = nbytes(a)
            spill.write(a.key, flat[offset : offset + size].view(a.dtype).reshape(a.shape))
            offset += size


def _array(entry) -> np.ndarray:
    """An entry's values: an array as it is, a variable's read now (a copy)."""
    return entry if isinstance(entry, np.ndarray) else np.asarray(entry.numpy(), order="C")


class _Shape(NamedTuple):
    """An entry's key, shape and dtype, which `byte_groups` groups as the sender's arrays."""

    key: str
    shape: tuple
    dtype: np.dtype
