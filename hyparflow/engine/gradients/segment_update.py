"""A pipeline stage's optimizer update segment by segment, as the step's last backward ends each.

Keras's compiled train step applies each gradient as soon as its backward has made it, so one
process never holds a model's whole gradient set. A stage that differentiates as one call and
then updates holds all of its gradients at once: beside its weights and Adam's two slots, a
fourth copy of its parameter bytes, which keeps a P=4 rank above a quarter of one process's
memory (docs/memory.md). Cut into segments (`SegmentedRunner`), the stage's last backward
finishes the later segments first; each segment's gradients are then final (with replicas,
once summed over them: one blocking in-place reduction of the segment's gradients as one flat
tensor), so its update runs there and its gradients go before the earlier segments' backward
makes theirs. The data-parallel equivalent of Keras's step holding about one segment.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from hyparflow import deferred
from hyparflow.comm.allreduce import GradientReducer
from hyparflow.engine.gradients.flat import FlatLayout
from hyparflow.engine.gradients.form import segments_for
from hyparflow.engine.gradients.path import SegmentHooks
from hyparflow.engine.gradients.update import applies_per_variable
from hyparflow.engine.gradients.update_plan import plan_segment, update_groups
from hyparflow.engine.weights import nbytes
from hyparflow.traced import traced


def segment_positions(variables: list, overlap, leave_out=()) -> list[list[int]]:
    """The positions of a segmented stage's `variables` in the segments its update applies:
    those final after each segment of the last backward (`overlap.ready_at`), then the rest;
    none of `leave_out` (ZeRO-2's tables, updated whole), and no part left empty."""
    return [part for _, part in _parts_after(variables, overlap, leave_out)]


def _parts_after(variables: list, overlap, leave_out=()) -> list[tuple]:
    """(the segment after which the part is final, None for the rest; its positions) of each
    non-empty part of `segment_positions`."""
    position = {id(v): i for i, v in enumerate(variables)}
    out = set(leave_out)
    parts = [
        (j, [position[id(v)] for _, v in overlap.ready_at[j] if position[id(v)] not in out])
        for j in sorted(overlap.ready_at)
    ]
    reached = {i for _, part in parts for i in part}
    left = [i for i in range(len(variables)) if i not in reached and i not in out]
    return [(j, part) for j, part in [*parts, (None, left)] if part]


class SegmentUpdate:
    """Apply a segmented stage's update during its step's last backward.

    `update` is the stage's `Update`, whose `run` applies each part as its `plan_segment`
    says (update groups at the step's counter, regularization added in each group's call),
    `runner` its `SegmentedRunner`, `overlap` the `gradient_sync.Overlap` plan saying which
    variables are final after which segment. Per step: `begin()`, the walk calls
    `on_segment_done(j)` after each segment of the last backward, `finish()` applies what no
    segment made (variables the loss does not reach: zeros, as the usual update) and returns
    the model's regularization.

    `replicas`: the stage's replica communicator (None: no replicas), over which each
    segment's gradients are summed before its update; `guard(operation)` watches that wait.
    `sharded`: a ZeRO-1 `ShardedUpdate` built over the same segments (`segment_positions`):
    each segment's gradients reduce-scattered, this replica's slice of it stepped, its parameters
    all-gathered, so no rank holds more than one segment's gradients or more than its slice of
    the optimizer state (the reduce-scatter sums them over the replicas).
    `scatter_each_backward` (ZeRO-2, `Strategy.shard_gradients`; needs `sharded`): every
    micro-batch's backward, not only the last, reduce-scatters each part as soon as it is
    made and adds it to this replica's slices, so the stage never holds more than one
    segment's gradients besides its slices. Steps whose update waits for every gradient
    (loss scaling, global clipping) then step the slices after the backward
    (`ShardedUpdate.apply_received`); the others step each part at the last backward.
    `tables` (positions of embedding tables; ZeRO-2 only) are in no part: their row slices,
    whole, are gathered from the replicas after the backward and stepped with the slices, or
    alone at the step's counter.
    """

    def __init__(
        self,
        update,
        runner,
        overlap,
        replicas=None,
        guard=None,
        sharded=None,
        scatter_each_backward=False,
        tables=(),
    ):
        self.update = update
        self.runner = runner
        if tables and not scatter_each_backward:
            raise ValueError("only ZeRO-2's segments leave embedding tables whole")
        self.tables = sorted(tables)
        parts = _parts_after(update.variables, overlap, self.tables)
        self.segment_positions = [part for _, part in parts]
        self._plans = [_segment_plan(update.variables, part) for part in self.segment_positions]
        if sharded is not None:
            theirs = [sorted(i for g in groups for i in g.positions) for groups in sharded.segments]
            if theirs != [sorted(part) for part in self.segment_positions]:
                raise ValueError("the ShardedUpdate was not built over this SegmentUpdate's parts")
        self.sharded = sharded
        if scatter_each_backward and sharded is None:
            raise ValueError("scatter_each_backward reduce-scatters into a ShardedUpdate's slices")
        self.scatters = scatter_each_backward
        self._received: dict[int, list] = {}  # ZeRO-2: part -> this replica's summed slices
        self._immediate = True  # whether each part is stepped at the last backward
        summed = replicas is None or sharded is not None
        self._reducer = None if summed else GradientReducer(replicas, op="sum")
        self._guard = guard or (lambda operation: contextlib.nullcontext())
        self._layouts: dict = {}  # positions -> (FlatLayout, compiled flatten)
        self._part_after = {j: k for k, (j, _) in enumerate(parts) if j is not None}
        self._usable_for: tuple = (None, False)
        self._step = 0
        self._regularization = 0.0
        self._applied: set[int] = set()  # parts applied this step
        self.early_updates = 0  # parts applied inside a backward (all steps)

    def usable(self) -> bool:
        """Whether the model's optimizer can update in parts: each variable's update reads
        only its own gradient (`applies_per_variable`: no loss scaling, moving averages or
        accumulation) and no clipping by a global norm, which needs every gradient first."""
        optimizer = self.update.model.optimizer
        if self._usable_for[0] is not optimizer:
            clips = self.update.clipping().needs_every_gradient
            ok = bool(self.update.variables) and applies_per_variable(optimizer) and not clips
            self._usable_for = (optimizer, ok)
        return self._usable_for[1]

    def serves(self, check_numerics: bool) -> bool:
        """Whether a step runs by segment: never with a finite check (it reads every gradient
        first); under ZeRO-2 in every other step (what waits for every gradient waits for the
        slices), else where the optimizer can update in parts (`usable`)."""
        if check_numerics or not self.update.variables:
            return False
        return self.scatters or self.usable()

    def begin(self) -> SegmentHooks:
        """Before the step: its optimizer step and the regularization of the weights as they
        are (Keras's loss adds it before any update); the walk's hooks."""
        self._step = int(self.update.model.optimizer.iterations.numpy())
        self._regularization = self.update.local_regularization()
        self._applied = set()
        self._immediate = self.usable()
        self._received = {}
        return SegmentHooks(
            last=self.on_segment_done, earlier=self.on_earlier_segment if self.scatters else None
        )

    def on_segment_done(self, j: int) -> None:
        """The last backward finished segment j: apply the variables now final."""
        self.runner.collect(j)
        k = self._part_after.get(j)
        if k is not None and k not in self._applied:
            self._apply(k)
            self.early_updates += self._immediate

    def on_earlier_segment(self, j: int) -> None:
        """ZeRO-2, a backward before the step's last finished segment j: its part's gradients
        so far reduce-scattered into this replica's slices and let go."""
        self.runner.collect(j)
        k = self._part_after.get(j)
        if k is not None:
            self._scatter(k)

    def finish(self) -> float:
        """Apply what is left; return the model's regularization (collective over the
        pipeline when any stage has regularizers)."""
        for k in range(len(self.segment_positions)):
            if k not in self._applied:
                self._apply(k)
        tables = self._reduced_tables()
        self.runner.reset()
        if not self._immediate:  # ZeRO-2 stepping every slice at once
            received, self._received = self._received, {}
            slices = [r for k in sorted(received) for r in received[k]]
            return self.sharded.apply_received(slices, tables)
        if tables:
            self.sharded.step_tables(tables, self._step)
        return self.update.sum_over_pipeline(self._regularization)

    def _reduced_tables(self) -> list:
        """ZeRO-2: the tables' row slices, gathered from every replica (collective)."""
        if not self.tables:
            return []
        return self.sharded.reduce_tables(self.runner.take_tables())

    def _scatter(self, k: int) -> None:
        """ZeRO-2: part k's gradients collected so far reduce-scattered (let go here) and
        added to this replica's slices of it."""
        positions = self.segment_positions[k]
        variables = self.update.variables
        grads = {i: self.runner.take(variables[i]) for i in positions}
        received = self.sharded.scatter_segment(k, grads)
        if k not in self._received:
            self._received[k] = received
            return
        for total, more in zip(self._received[k], received, strict=True):
            total += more

    def _apply(self, k: int) -> None:
        self._applied.add(k)
        if self.scatters:
            self._scatter(k)
            if self._immediate:
                self.sharded.step_segment(k, self._received.pop(k), self._step)
            return
        positions = self.segment_positions[k]
        variables = self.update.variables
        grads = [self.runner.take(variables[i]) for i in positions]
        if self.sharded is not None:
            self.sharded.apply_segment(k, dict(zip(positions, grads, strict=True)), self._step)
        else:
            if self._reducer is not None:
                grads = self._summed(grads, positions)
            self.update.run(self._plans[k], grads, step=self._step)

    def _summed(self, grads: list, positions: list[int]) -> list:
        """`grads` summed over the replicas: concatenated into one fresh flat tensor (which
        this process alone owns), reduced in place, handed back as views of it."""
        key = tuple(positions)
        if key not in self._layouts:
            layout = FlatLayout([self.update.variables[i] for i in positions])
            flatten = traced(lambda g, layout=layout: layout.flatten(g, 0.0))
            self._layouts[key] = (layout, flatten)
        layout, flatten = self._layouts[key]
        flat = flatten([tf.convert_to_tensor(g) for g in grads])
        grads.clear()  # the flat tensor holds them now
        with self._guard("sum a segment's gradients over the replicas"):
            flat = self._reducer.reduce_flat(flat)
        return list(layout.unflatten_fn(flat))


def _segment_plan(variables: list, positions: list[int]):
    """The update of the variables at `positions` (a part), in update groups."""
    groups = update_groups([variables[i] for i in positions])
    return plan_segment([[positions[j] for j in group] for group in groups])


def segment_count(strategy, model, variables, replicas: int = 1) -> int:
    """How many segments the stage's update runs in (Strategy.update_by_segment; by default
    segments only for hf.scope() models, which put memory first; at least 2 where ZeRO-2
    reduce-scatters them over `replicas`; more allowed where ZeRO-3 gathers each one whole)."""
    asked = strategy.update_by_segment
    gathered = strategy.shard_weights and replicas > 1
    count = segments_for(sum(nbytes(v) for v in variables), gathered)
    if asked is True or (strategy.shard_gradients and replicas > 1):
        return max(2, count)
    if asked is False or not deferred.built_in_scope(model):
        return 1
    return count
