"""What checkpoints see of a ZeRO stage: each replica's slices of the optimizer slots, and
under ZeRO-3 of the weights while the slices hold them.

Each replica saves only the slots of its slice, as ranges of the flattened entries that an
unsharded run writes whole (`opt/<i>/<slot>#<start>:<stop>/<shape>`, after the tensor piece's
`@<t>/<T>:<axis>` where there is one; `checkpoint.reader.LazyState` joins them on reading).
Under ZeRO-3, while the model's variables are let go (a checkpoint inside an epoch), each
replica saves its slices of the weights the same way (`w/<i>#<start>:<stop>/<shape>`), so no
rank gathers them to save. Restoring takes whole entries, however they were written, and cuts
this replica's slice: ZeRO on or off, any replica count, pipeline or tensor layout
(docs/zero.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hyparflow.checkpoint.state import slice_key

if TYPE_CHECKING:
    from hyparflow.engine.sharded_optimizer.optimizer_slices import SliceSet


class SliceCheckpoint:
    """`checkpoint/stage.py`'s `optimizer_shard` for a `ShardedUpdate` `sharded` (or the
    `OptimizerSlices` of one optimizer of a model's own step). `built_for`: the variables a
    whole optimizer of this state is built for (None: the model's trainable variables; a
    model's own step may apply an optimizer to part of them).

    Example:
        TrainingState(..., optimizer_shard=SliceCheckpoint(sharded))
    """

    def __init__(self, sharded: SliceSet, weights=None, built_for=None):
        self.sharded = sharded
        self.weights = weights  # ZeRO-3's `ShardedWeights`, or None
        self.built_for = built_for

    def holds_slices(self, variable) -> bool:
        """Whether `variable`'s value is now only in the replicas' slices (ZeRO-3 while
        training: `weights_state` writes it, and the variable cannot be read)."""
        return self.weights is not None and self.weights.released and self.weights.holds(variable)

    def weights_state(self, model, split: dict, shard: int) -> dict:
        """This replica's slices of the weights the slices hold now (`holds_slices`), as
        ranges of the flattened `w/<i>` entries (`slice_key`; a tensor piece's of its piece's
        key); nothing where the variables hold their values."""
        if self.weights is None or not self.weights.released:
            return {}
        keys = {v.path: f"w/{i}" for i, v in enumerate(model.weights)}
        state = {}
        for group in self.weights.groups:
            value = np.asarray(group.variable.numpy())
            state.update(_slice_entries(group, self.weights.variables, value, split, shard, keys))
        return state

    def _slot_of(self, name: str):
        """(slice group, table, slot name) of the optimizer variable named `name`: a slot of
        a dtype group's slice or of a variable updated whole (an embedding table, an expert
        shard), or neither (the optimizer's own step, learning rate, loss scale)."""
        for group in self.sharded.groups:
            if name.startswith(group.slot_prefix):
                return group, None, name[len(group.slot_prefix) :]
        for prefix, table in sorted(self.sharded.table_prefixes, key=lambda p: -len(p[0])):
            if name.startswith(prefix):
                return None, table, name[len(prefix) :]
        return None, None, None

    def optimizer_state(self, model, split: dict, shard: int, replica: int) -> dict:
        """This replica's share of the optimizer state: its slice of each slot as ranges of the
        flattened entries (`slice_key`); tables' slots and the optimizer's own variables from
        replica 0, expert shards' from the first expert group (each piece once,
        `Piece.written_by`). Whole variables are written by tensor rank 0 only, as unsharded
        runs do."""
        index = {v.path: i for i, v in enumerate(model.trainable_variables)}
        state = {}
        for opt_variable in self.sharded.optimizer.variables:
            group, table, slot = self._slot_of(opt_variable.name)
            value = np.asarray(opt_variable.numpy())
            if group is None:  # the optimizer's own, or a whole table's or expert shard's slot
                piece = None if table is None else split.get(table.path)
                first = replica == 0 and shard == 0
                if first if piece is None else piece.written_by(shard, replica):
                    key = f"opt/{opt_variable.name}"
                    if table is not None:
                        key = _key(index, table, slot, piece)
                    state[key] = value
                continue
            keys = {path: f"opt/{i}/{slot}" for path, i in index.items()}
            state.update(_slice_entries(group, self.sharded.variables, value, split, shard, keys))
        return state

    def restore_optimizer(self, model, state: dict, split: dict) -> None:
        """Build the optimizer for the slices and load them from a joined checkpoint `state`
        (whole entries, whichever layout wrote them)."""
        self.sharded.build_optimizer()
        index = {v.path: i for i, v in enumerate(model.trainable_variables)}
        missing = []

        def whole(variable, slot):
            """The entry of `slot` of `variable` (this rank's piece of a tensor shard's)."""
            key = f"opt/{index[variable.path]}/{slot}"
            if key not in state:
                missing.append(key)
                return None
            piece = split.get(variable.path)
            return state[key] if piece is None else piece.cut(state[key])

        for opt_variable in self.sharded.optimizer.variables:
            group, table, slot = self._slot_of(opt_variable.name)
            if table is not None:
                value = whole(table, slot)
            elif group is None:
                value = state.get(f"opt/{opt_variable.name}")
                if value is None:
                    missing.append(opt_variable.name)
            else:
                value = np.zeros(group.layout.slice_size, opt_variable.dtype)
                for p in group.extents:
                    entry = whole(self.sharded.variables[group.positions[p.variable]], slot)
                    if entry is not None:
                        value[p.offset : p.offset + p.size] = np.ravel(entry)[p.start : p.stop]
            if value is not None:
                opt_variable.assign(value)
        if missing:
            raise ValueError(
                f"The checkpoint has no optimizer state for {missing[:3]}; it was written with a "
                "different optimizer. Compile with the optimizer it was trained with, or start "
                "without resume."
            )


def _slice_entries(group, variables: list, value, split: dict, shard: int, keys: dict) -> dict:
    """This replica's `value` (its slice of `group`'s flat vector) as ranges of the flattened
    entries of the variables it overlaps (`slice_key`): `keys[path]` names a whole variable's
    entry, a tensor piece's is its piece's key. Whole variables are written by the first
    tensor rank's replicas only (every tensor rank holds them alike)."""
    state = {}
    for p in group.extents:
        variable = variables[group.positions[p.variable]]
        piece = split.get(variable.path)
        if piece is None and shard != 0:
            continue
        key = keys[variable.path] if piece is None else piece.key(keys[variable.path])
        state[slice_key(key, p.start, p.stop, tuple(variable.shape))] = value[
            p.offset : p.offset + p.size
        ]
    return state


def _key(index: dict, variable, slot: str, piece) -> str:
    """The key of `slot` of `variable` as an unsharded run writes it (a tensor piece's with
    its `Piece`)."""
    key = f"opt/{index[variable.path]}/{slot}"
    return key if piece is None else piece.key(key)
