"""ZeRO-3: each of a stage's R replicas holds 1/R of the stage's weights between steps.

`Strategy(shard_weights=True)` (docs/zero.md, "ZeRO-3"). The slices are the slice variables
ZeRO-1 steps (`ShardedUpdate`'s groups, one flat vector per dtype of each segment), and while
hf.fit trains they are the weights' only copy: the model's dense variables are let go
(`deferred.let_go`) after their values are copied into the slices, and each segment's runner
reads its weights from `gather_for` (an all-gather of the slices that hold them) before its
forward, and again before its backward recomputes that forward; the values live only during
that call. At the fit's end `restore` all-gathers every slice back into the variables, one
group at a time. Embedding tables and expert shards are not sliced: they stay whole in
their variables.

Rajbhandari et al. 2020, "ZeRO", stage 3 (parameter partitioning); PyTorch's FSDP (Zhao et
al., VLDB 2023) gathers a unit's parameters in the same places.
"""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

from hyparflow import deferred
from hyparflow.engine import events

_WHILE_TRAINING = (
    "hf.fit holds this weight as slices spread over the replicas while it trains "
    "(Strategy shard_weights=True); the fit's end gives it back. Read weights after hf.fit, "
    "or train with shard_weights=False where a callback must read them during the fit."
)


class ShardedWeights:
    """The stage's dense weights as this replica's slices of `segments` (`sliced_segments`:
    per segment, a `_DtypeSlice` per dtype, with positions in `variables`, their
    `SliceLayout` and this replica's slice `variable`), gathered over `comm` (the stage's
    replicas); `guard(operation)` watches each wait, `span(kind)` times each gather
    (`events.Spans.span`: recorded inside a training step's forward and backward).

    `sent_bytes` counts the bytes this rank has sent in its all-gathers (ring volume),
    `restores` the times the variables were given their values back.

    Example:
        weights = ShardedWeights(segments, variables, comm, guard)
        weights.release()                 # slices take the values; the variables let go
        read = weights.gather_for(layer_variables)
        values = read()                   # collective: every replica calls it alike
        weights.restore()                 # collective: the variables hold values again
    """

    def __init__(self, segments: list, variables: list, comm, guard, span=None):
        self.segments, self.variables, self.comm = segments, variables, comm
        self._span = span or (lambda kind: contextlib.nullcontext())
        self.groups = [group for groups in segments for group in groups]
        self._guard = guard
        self._where = {}  # id(variable) -> (its group's index, its index in the group)
        for g, group in enumerate(self.groups):
            for j, i in enumerate(group.positions):
                self._where[id(variables[i])] = (g, j)
        self.released = False
        self.sent_bytes = 0
        self.restores = 0

    def holds(self, variable) -> bool:
        """Whether `variable` is sliced here (tables and expert shards are not)."""
        return id(variable) in self._where

    def load(self, initial: bool = True) -> None:
        """Each slice takes its elements of the variables (the truth while they hold values:
        restores, `set_weights` and callbacks write those), one variable at a time; a
        variable built under hf.scope() and never held gives its initial value (`initial`;
        else its elements stay as the slice has them: nothing can have written it since).
        The elements are copied out (numpy): a TensorFlow slice may share its whole
        variable's buffer, and a slice variable assigned from it would keep that buffer
        alive."""
        for group in self.groups:
            values = np.zeros(group.layout.slice_size, group.dtype)
            if not initial:
                values[:] = group.variable.numpy()
            for p in group.extents:
                variable = self.variables[group.positions[p.variable]]
                never_held = deferred.is_deferred(variable)
                if never_held and not initial:
                    continue
                held = deferred.initial_value(variable) if never_held else variable
                flat = np.asarray(held).reshape(-1)
                values[p.offset : p.offset + p.size] = flat[p.start : p.stop]
                held = flat = None
            group.variable.assign(values)

    def release(self) -> None:
        """Copy the variables' values into the slices, then let the variables go (their
        memory with them): the slices are the weights until `restore`. Variables built
        under hf.scope() and never held stay as they are."""
        if self.released:
            return
        self.load(initial=False)  # the initial values of those never held were loaded first
        held = [
            self.variables[i]
            for group in self.groups
            for i in group.positions
            if not deferred.is_deferred(self.variables[i])
        ]
        deferred.let_go(held, _WHILE_TRAINING)
        self.released = True

    def restore(self, over=None) -> None:
        """Give the variables their values again, all-gathered from the slices one group at a
        time (collective over the replicas: `comm`, or `over`, a communicator of the same
        replicas in the same order that no failed step has left mid-collective)."""
        if not self.released:
            return
        for group in self.groups:
            flat = self._all_gathered(group, over or self.comm)
            for j, i in enumerate(group.positions):
                deferred.hold(self.variables[i], self._value_in(flat, group, j))
            flat = None
        self.released = False
        self.restores += 1

    def gather_for(self, variables: list):
        """A callable returning the current values of `variables` (each sliced here), in
        order, all-gathered from the replicas' slices (collective when called)."""
        places = [self._where[id(v)] for v in variables]
        wanted = sorted({g for g, _ in places})

        def gather() -> list:
            flats = {g: self._all_gathered(self.groups[g], self.comm) for g in wanted}
            return [self._value_in(flats[g], self.groups[g], j) for g, j in places]

        return gather

    def _all_gathered(self, group, comm) -> np.ndarray:
        """The group's whole padded flat vector: every replica's slice, in rank order over
        `comm`."""
        mine = np.ascontiguousarray(group.variable.numpy())
        whole = np.empty(group.layout.padded, mine.dtype)
        with self._span(events.GATHER), self._guard("all-gather the weights over the replicas"):
            # bytes, so that any dtype travels (MPI has no float16 or bfloat16)
            comm.Allgather(mine.view(np.uint8), whole.view(np.uint8))
        self.sent_bytes += group.allgather_bytes
        return whole

    def _value_in(self, flat: np.ndarray, group, j: int):
        """Variable j of `group` as a tensor of its shape, read out of the group's `flat`."""
        variable = self.variables[group.positions[j]]
        start = group.layout.offsets[j]
        values = flat[start : start + group.layout.sizes[j]].reshape(tuple(variable.shape))
        return tf.constant(values)
