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
import time
from concurrent.futures import Future
from functools import partial

import numpy as np
import tensorflow as tf

from hyparflow import deferred
from hyparflow.comm.background import BackgroundCollectives
from hyparflow.comm.failure import unwatched as _unwatched
from hyparflow.comm.traffic import TrafficLog
from hyparflow.engine import events

TRANSFER_TAG = "gather"  # the steps' all-gathers of weights, on the gather thread
WAIT_TAG = "gather/wait"  # the steps' waits for them: the part compute did not hide
_WHILE_TRAINING = (
    "hf.fit holds this weight as slices spread over the replicas while it trains "
    "(Strategy shard_weights=True); the fit's end gives it back. Read weights after hf.fit, "
    "or train with shard_weights=False where a callback must read them during the fit."
)
_KEPT_SLICED = (
    "the model was built under hf.scope() and trained with Strategy shard_weights=True, so "
    "each replica keeps only its slices of the weights, during hf.fit and after it (the "
    "whole model may not fit one rank). hf.evaluate and hf.predict gather them as they run; "
    "to write the whole model, save with hf.callbacks.Checkpoint and write one file with "
    "hf.export(checkpoint_dir, path), one variable at a time."
)


class ShardedWeights:
    """The stage's dense weights as this replica's slices of `segments` (`sliced_segments`:
    per segment, a `_DtypeSlice` per dtype, with positions in `variables`, their
    `SliceLayout` and this replica's slice `variable`), gathered over `comm` (the stage's
    replicas); `guard(operation)` watches each wait, `span(kind)` times each gather
    (`events.Spans.span`: recorded inside a training step's forward and backward).

    `keeps_slices` (a model built under hf.scope()): the trainer never gives the whole
    weights back but after a failed step (`restore` is the caller's choice), and a read of a
    let-go variable says so.
    `sent_bytes` counts the bytes this rank has sent in its all-gathers (ring volume),
    `restores` the times the variables were given their values back. `traffic` (a
    `TrafficLog`) gets the steps' gathers (`TRANSFER_TAG`: calls, bytes, seconds on the gather
    thread) and their waits (`WAIT_TAG`: seconds the step waited for them).

    Example:
        weights = ShardedWeights(segments, variables, comm, guard)
        weights.release()                 # slices take the values; the variables let go
        read = weights.gather_for(layer_variables)
        values = read()                   # collective: every replica calls it alike
        weights.restore()                 # collective: the variables hold values again
    """

    def __init__(
        self,
        segments: list,
        variables: list,
        comm,
        guard,
        span=None,
        traffic=None,
        keeps_slices: bool = False,
    ):
        self.segments, self.variables, self.comm = segments, variables, comm
        self.keeps_slices = keeps_slices
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
        # the gathers of training steps run on a thread of their own, over a duplicate of
        # `comm` made at the first; `traffic` counts them (TRANSFER_TAG) and the time the
        # steps waited for them (WAIT_TAG): the rest of their time compute hid
        self._ahead = self._ahead_comm = None
        traffic = traffic or TrafficLog()
        self._transfers, self._waits = traffic.of(TRANSFER_TAG), traffic.of(WAIT_TAG)

    def holds(self, variable) -> bool:
        """Whether `variable` is sliced here (tables and expert shards are not)."""
        return id(variable) in self._where

    def load(self, initial: bool = True) -> None:
        """Each slice takes its elements of the variables (the truth while they hold values:
        restores, `set_weights` and callbacks write those), one variable at a time; a
        variable built under hf.scope() and never held gives its initial value (`initial`),
        and one let go leaves the slice's elements as they are (nothing can have written it
        since). The elements are copied out (numpy): a TensorFlow slice may share its whole
        variable's buffer, and a slice variable assigned from it would keep that buffer
        alive."""
        for group in self.groups:
            values = np.array(group.variable.numpy(), group.dtype)
            for p in group.extents:
                variable = self.variables[group.positions[p.variable]]
                held = _held_value(variable, initial)
                if held is None:
                    continue
                flat = np.asarray(held).reshape(-1)
                values[p.offset : p.offset + p.size] = flat[p.start : p.stop]
                held = flat = None
            group.variable.assign(values)

    def take_over(self) -> None:
        """The sliced variables get backings that can be emptied and filled again
        (`deferred.take_over`; those never held start empty, their values in the slices: call
        after `load`), so that steps traced over them stay valid through every `release`
        and `restore`."""
        reason = _KEPT_SLICED if self.keeps_slices else _WHILE_TRAINING
        deferred.take_over(self._sliced_variables(), reason)

    def _sliced_variables(self) -> list:
        return [self.variables[i] for group in self.groups for i in group.positions]

    def release(self) -> None:
        """Copy the variables' values into the slices, then let the variables go (their
        memory with them): the slices are the weights until `restore`."""
        if self.released:
            return
        self.load(initial=False)
        self.take_over()  # nothing where done already
        deferred.let_go(self._sliced_variables())
        self.released = True

    def restore(self, over=None) -> None:
        """Give the variables their values again, all-gathered from the slices one group at a
        time (collective over the replicas: `comm`, or `over`, a communicator of the same
        replicas in the same order that no failed step has left mid-collective)."""
        if not self.released:
            return
        for g, group in enumerate(self.groups):
            flat = self._all_gathered(group, over or self.comm)
            for j, i in enumerate(group.positions):
                deferred.hold(self.variables[i], self.value_in(flat, g, j))
            flat = None
        self.released = False
        self.restores += 1

    def gather_for(self, variables: list) -> WeightGather:
        """What returns the current values of `variables` (each sliced here), in order,
        all-gathered from the replicas' slices (collective when called), and can start that
        gather ahead (`WeightGather.prefetch`)."""
        places = [self._where[id(v)] for v in variables]
        return WeightGather(self, places)

    def start_gathers(self, numbers: list) -> list:
        """Start all-gathering groups `numbers` on the gather thread, in order: their
        futures, each of the group's whole padded flat vector (`finish_gathers` waits)."""
        return [self.start_gather(g, self.groups[g].variable.numpy()) for g in numbers]

    def start_gather(self, g: int, mine: np.ndarray) -> Future:
        """Start all-gathering group g on the gather thread, `mine` this replica's slice (an
        array of the caller's that nothing else writes meanwhile): the future of the group's
        whole padded flat vector."""
        if self._ahead is None:
            self._ahead = BackgroundCollectives("hyparflow-gather")
            self._ahead_comm = _unwatched(self.comm.Dup())
        mine = np.ascontiguousarray(mine)
        return self._ahead.submit(partial(self._transfer, self.groups[g], mine))

    def finish_gathers(self, started: list) -> list:
        """The flat vectors of `started` (`start_gathers`), once the thread has them; the
        wait is the gather time compute did not hide (timed as a gather span)."""
        begin = time.perf_counter()
        with self._span(events.GATHER), self._guard("all-gather the weights over the replicas"):
            flats = [self._ahead.wait(future) for future in started]
        self._waits.record(begin, time.perf_counter(), 0)
        return flats

    def _transfer(self, group, mine: np.ndarray) -> np.ndarray:
        """On the gather thread: the group's whole padded flat vector over its communicator."""
        begin = time.perf_counter()
        whole = self.joined(group, mine, self._ahead_comm)
        self._transfers.record(begin, time.perf_counter(), group.allgather_bytes)
        return whole

    def close(self) -> None:
        """Stop the gather thread and free its communicator (collective where one exists)."""
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead_comm.Free()
            self._ahead = self._ahead_comm = None

    def _all_gathered(self, group, comm) -> np.ndarray:
        """The group's whole padded flat vector: every replica's slice, in rank order over
        `comm` (blocking, on this thread: the restores)."""
        mine = np.ascontiguousarray(group.variable.numpy())
        with self._guard("all-gather the weights over the replicas"):
            return self.joined(group, mine, comm)

    def joined(self, group, mine: np.ndarray, comm) -> np.ndarray:
        """The group's whole padded flat vector, every replica's slice (`mine` this one's)
        in rank order over `comm`."""
        whole = np.empty(group.layout.padded, mine.dtype)
        # bytes, so that any dtype travels (MPI has no float16 or bfloat16)
        comm.Allgather(mine.view(np.uint8), whole.view(np.uint8))
        self.sent_bytes += group.allgather_bytes
        return whole

    def value_in(self, flat: np.ndarray, g: int, j: int):
        """Variable j of group `g` as a tensor of its shape, read out of the group's `flat`."""
        group = self.groups[g]
        variable = self.variables[group.positions[j]]
        start = group.layout.offsets[j]
        values = flat[start : start + group.layout.sizes[j]].reshape(tuple(variable.shape))
        return tf.constant(values)


def _held_value(variable, initial: bool):
    """What `ShardedWeights.load` copies from `variable`: its value, its initial value where
    it was never held (and `initial`), or None where the slice keeps its elements."""
    if deferred.is_let_go(variable):
        return None
    if deferred.is_deferred(variable):
        return deferred.initial_value(variable) if initial else None
    return variable


class WeightGather:
    """The current values of some variables of a `ShardedWeights` (`places`: each one's group
    and index in it), all-gathered from the replicas' slices when called (collective: every
    replica calls it alike). `prefetch()` starts that gather on the gather thread, so that
    it runs while the caller computes something else; the next call then waits for it."""

    def __init__(self, weights: ShardedWeights, places: list):
        self._weights, self._places = weights, places
        self._groups = sorted({g for g, _ in places})
        self._started = None

    def prefetch(self) -> None:
        """Start the gather now (nothing if one is started and not taken yet)."""
        if self._started is None:
            self._started = self._weights.start_gathers(self._groups)

    def __call__(self) -> list:
        self.prefetch()
        started, self._started = self._started, None
        flats = dict(zip(self._groups, self._weights.finish_gathers(started), strict=True))
        return [self._weights.value_in(flats[g], g, j) for g, j in self._places]
