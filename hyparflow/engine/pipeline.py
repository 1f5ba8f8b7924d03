"""The pipeline walk: a stage's micro-batches through its schedule's actions and its channels."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow.comm import p2p
from hyparflow.comm.p2p import PipeChannel
from hyparflow.data import GlobalBatch, split_bounds
from hyparflow.engine import events
from hyparflow.engine.structure import model_input_list
from hyparflow.schedule import (
    ActionKind,
    forward_only,
    make_schedule,
    validate,
    with_transfers,
)
from hyparflow.traced import traced


class MicroBatch(NamedTuple):
    """One micro-batch of this replica's shard, as the stage needs it: `x` at the first stage,
    `y` and `sample_weight` at the last (None elsewhere); `size` rows starting at row `offset`
    of the global batch."""

    x: Any
    y: Any
    sample_weight: Any
    size: int
    offset: int


class PipelineWalk:
    """Runs one stage's actions (GPipe, 1F1B, ZB-H1, forward-only) for a step's micro-batches.

    Cuts the replica's shard of a global batch into micro-batches, runs each forward and
    backward on `runner`, and moves activations and gradients to the neighbouring stages over
    `PipeChannel`s (one pair per micro-batch size and count, kept for later steps). `stage` is
    the partitioner's stage (None: the whole model, with no neighbours).

    - `guard(operation, peer, microbatch)` watches each blocking wait; `span` (set by the
      trainer's recorder) times each action.
    - `loss(y, y_pred, sample_weight)` and `update_metrics(...)` (compiled) serve evaluation
      and the metrics a runner does not update itself.
    - `seed_variables`: the stage's random seed states, put back before each training forward
      so that every micro-batch draws from the step's seeds, as one full-batch call would.
    - `whole_inputs`: the first stage passes the user's `x` as is (an unpartitioned model of
      any structure), else as a list in `model.inputs` order.
    """

    def __init__(
        self, model, topology, strategy, stage, runner, *, guard, loss, update_metrics,
        seed_variables, whole_inputs,
    ):  # fmt: skip
        self.model, self.topology, self.strategy = model, topology, strategy
        self.stage, self.runner = stage, runner  # what this rank computes, and how
        self.is_first, self.is_last = topology.is_first_stage, topology.is_last_stage
        self._guard = guard
        self._loss, self._update_metrics_fn = loss, update_metrics
        self._eval_loss_fn = None
        self._seed_variables, self._whole_inputs = seed_variables, whole_inputs
        self.span = events.no_span
        self.channels: dict[tuple, tuple] = {}  # (largest micro-batch, count) -> (prev, next)
        self._schedules: dict[tuple, tuple] = {}  # (train, micro-batches) -> this stage's actions
        self._added_parts: list = []  # this step's (micro-batch size, added loss)

    def take_added(self) -> list:
        """The (micro-batch size, added loss) of each forward since the last call."""
        parts, self._added_parts = self._added_parts, []
        return parts

    def microbatches(self, batch: GlobalBatch) -> list[MicroBatch]:
        """This replica's shard of `batch` cut into micro-batches."""
        topo = self.topology
        start, stop = split_bounds(batch.size, topo.num_replicas, topo.replica)
        shard = stop - start
        if shard == 0:
            return []
        x, y, sw = batch.part(start, stop)
        count = min(self.strategy.microbatches, shard)
        microbatches = []
        for k in range(count):
            a, b = split_bounds(shard, count, k)
            cut = slice(a, b)
            microbatches.append(
                MicroBatch(
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
        return microbatches

    def run(
        self, microbatches: list[MicroBatch], global_size: int, *, train: bool, predict=False,
        loss_scale=1.0, on_segment_done=None,
    ):  # fmt: skip
        """Walk this stage's actions for the micro-batches; return the last stage's results.

        `loss_scale` multiplies every training micro-batch's loss weight (at every stage:
        losses added in an earlier stage are scaled like the last stage's);
        `on_segment_done(j)`, if given, runs after each segment of the step's last backward.
        """
        if not microbatches:
            return []
        step = _Step(self, microbatches, global_size, train=train, predict=predict)
        step.loss_scale = loss_scale
        actions = self._stage_actions(train, len(microbatches))
        backwards = [a.microbatch for a in actions if a.kind is ActionKind.BACKWARD]
        if backwards and on_segment_done is not None:
            # the step's last backward: every gradient of this stage is final after it
            step.on_segment_done = (backwards[-1], on_segment_done)
        for action in actions:
            step.act(action)
        step.complete_sends()
        return step.results

    def close(self) -> None:
        for channels in self.channels.values():
            for channel in channels:
                if channel is not None:
                    channel.close()

    def _links(self, max_microbatch: int, num_microbatches: int):
        """Channels to the previous and next stage sized for micro-batches of this size."""
        key = (max_microbatch, num_microbatches)
        if key not in self.channels:
            topo, stage = self.topology, self.stage

            def channel(peer, boundary):
                specs = [((max_microbatch, *t.shape), t.dtype) for t in boundary]
                floats = [s for s in specs if tf.as_dtype(s[1]).is_floating]  # carry gradients
                return PipeChannel(
                    topo.pipeline_comm, peer, specs, num_microbatches, backward_specs=floats
                )

            prev = None if self.is_first else channel(topo.prev_rank, stage.receives)
            nxt = None if self.is_last else channel(topo.next_rank, stage.sends)
            self.channels[key] = (prev, nxt)
        return self.channels[key]

    def _stage_actions(self, train: bool, count: int) -> tuple:
        """This stage's actions, transfers included, for a step of `count` micro-batches
        (built and validated, every stage's with its transfers, once per count)."""
        key = (train, count)
        if key not in self._schedules:
            p = self.topology.num_stages
            if train:
                schedule = make_schedule(self.strategy.schedule, p, count)
            else:
                schedule = forward_only(p, count)
            lowered = [with_transfers(actions, s, p) for s, actions in enumerate(schedule)]
            validate(lowered, count, training=train)
            self._schedules[key] = tuple(lowered[self.topology.stage])
        return self._schedules[key]

    def _post_receives(self, prev, count: int) -> dict:
        """The step's activation receives, posted up front so that transfers land while this
        stage computes (a gradient receive is posted when its activation leaves, by the
        schedule walk: at the first stage, posting them all here would delay its first forward,
        which every later stage waits for)."""
        if prev is None:
            return {}
        return {(p2p.FORWARD, k): self._receive(prev, k, p2p.FORWARD) for k in range(count)}

    def _receive(self, channel, k: int, direction: str):
        """Micro-batch `k`'s receive from `channel`: posted now with `overlap_p2p`, else a
        blocking receive posted when waited for."""
        if self.strategy.overlap_p2p:
            return channel.irecv(k, direction)
        return _DeferredReceive(channel, k, direction)

    def _finish_forward(self, out, mb: MicroBatch, train: bool, predict: bool):
        """The last stage's result of one forward: outputs (predict), else (loss, size)."""
        y, sw = mb.y, mb.sample_weight
        if predict:
            # Copy: forwarded outputs may be views of receive buffers reused next step.
            return tree.map_structure(lambda t: np.array(t, copy=True), out)
        if train:
            y_pred, loss = out
        else:
            y_pred = out
            if self._eval_loss_fn is None:
                self._eval_loss_fn = traced(self._loss, reduce_retracing=True)
            loss = self._eval_loss_fn(y, y_pred, sw)
        if not (train and self.runner.updates_metrics):
            self._update_metrics_fn(y, y_pred, sw)
        return loss, mb.size


class _Step:
    """One step's walk at this stage: its channels, posted receives, the tensors between an
    action and the next that uses them, and the last stage's results. `act` runs one action
    (the walk's order); each kind of action has its method."""

    loss_scale = 1.0
    on_segment_done: tuple | None = None  # (micro-batch of the step's last backward, callback)

    def __init__(self, walk: PipelineWalk, microbatches, global_size: int, *, train, predict):
        self.walk, self.microbatches, self.global_size = walk, microbatches, global_size
        self.train, self.predict = train, predict
        topo, count = walk.topology, len(microbatches)
        if walk.stage is None:
            self.prev = self.next = None
        else:
            self.prev, self.next = walk._links(max(m.size for m in microbatches), count)
        grid = topo.grid
        self.before = (
            grid.rank_of(topo.stage - 1, topo.replica, topo.shard) if not walk.is_first else None
        )
        self.after = (
            grid.rank_of(topo.stage + 1, topo.replica, topo.shard) if not walk.is_last else None
        )
        self.posted = walk._post_receives(self.prev, count)
        self.seeds = _SeedSnapshot(walk._seed_variables) if train and count > 1 else None
        self.results: list = []
        self.held: dict[tuple, Any] = {}  # (kind of the action that uses it, k) -> tensors
        self._methods = {
            ActionKind.RECV_ACTIVATIONS: self.receive_activations,
            ActionKind.FORWARD: self.forward,
            ActionKind.SEND_ACTIVATIONS: self.send_activations,
            ActionKind.RECV_GRADIENTS: self.receive_gradients,
            ActionKind.BACKWARD: self.backward,
            ActionKind.WEIGHT: self.weight,
            ActionKind.SEND_GRADIENTS: self.send_gradients,
        }
        if train and not walk.is_first and walk.runner.flat_backward:
            # Pack while this stage waits for its first activations, off the critical path.
            with walk.span(events.FORWARD):
                walk.runner.prepare()

    def act(self, action) -> None:
        self._methods[action.kind](action.microbatch)

    def receive_activations(self, k: int) -> None:
        """Wait for micro-batch `k`'s inputs from the previous stage."""
        received = self._wait(k, p2p.FORWARD, "receive activations", self.before)
        self.held[ActionKind.FORWARD, k] = received

    def forward(self, k: int) -> None:
        """Micro-batch `k`'s forward, on its data (first stage) or received inputs."""
        walk, runner = self.walk, self.walk.runner
        mb = self.microbatches[k]
        if self.seeds is not None:  # every micro-batch draws from the step's seeds
            self.seeds.restore()
        if walk.is_first:
            inputs = mb.x if walk._whole_inputs else model_input_list(walk.model, mb.x)
        else:
            inputs = self.held.pop((ActionKind.FORWARD, k))
        with walk.span(events.FORWARD, k):
            if self.train:
                out = runner.forward(
                    k,
                    inputs,
                    (mb.y, mb.sample_weight),
                    scale=mb.size / self.global_size * self.loss_scale,
                    rows=(mb.offset, self.global_size),
                )
            else:
                out = runner.infer(inputs)
            if not self.predict:
                walk._added_parts.append((mb.size, runner.last_added))
            if walk.is_last:
                self.results.append(walk._finish_forward(out, mb, self.train, self.predict))
            else:
                self.held[ActionKind.SEND_ACTIVATIONS, k] = out

    def send_activations(self, k: int) -> None:
        """Send micro-batch `k`'s outputs to the next stage; in training, post the receive of
        their gradients (they cannot come back before the outputs have gone)."""
        walk = self.walk
        with walk.span(events.SEND, k):
            self.next.isend(self.held.pop((ActionKind.SEND_ACTIVATIONS, k)), k, p2p.FORWARD)
            if self.train:
                self.posted[p2p.BACKWARD, k] = walk._receive(self.next, k, p2p.BACKWARD)

    def receive_gradients(self, k: int) -> None:
        """Wait for the gradients of micro-batch `k`'s outputs from the next stage."""
        received = self._wait(k, p2p.BACKWARD, "receive gradients", self.after)
        self.held[ActionKind.BACKWARD, k] = received

    def _wait(self, k: int, direction: str, operation: str, peer):
        """Micro-batch `k`'s posted receive in `direction` from `peer`, once it has landed."""
        walk = self.walk
        with walk.span(events.RECV, k), walk._guard(operation, peer, k):
            return self.posted.pop((direction, k)).wait(self.microbatches[k].size)

    def backward(self, k: int) -> None:
        """Micro-batch `k`'s backward; after the step's last one, `on_segment_done` (as for
        `PipelineWalk.run`) runs as each segment finishes."""
        walk = self.walk
        grads = self.held.pop((ActionKind.BACKWARD, k), None)  # None at the last stage
        with walk.span(events.BACKWARD, k):
            if self.on_segment_done is not None and self.on_segment_done[0] == k:
                input_grads = walk.runner.backward(k, grads, self.on_segment_done[1])
            else:
                input_grads = walk.runner.backward(k, grads)
        if not walk.is_first:
            self.held[ActionKind.SEND_GRADIENTS, k] = input_grads

    def weight(self, k: int) -> None:
        """Micro-batch `k`'s weight gradients, where its backward left them (zero-bubble
        schedules)."""
        with self.walk.span(events.WEIGHT, k):
            self.walk.runner.weight(k)

    def send_gradients(self, k: int) -> None:
        """Send micro-batch `k`'s input gradients back to the previous stage."""
        input_grads = self.held.pop((ActionKind.SEND_GRADIENTS, k))
        with self.walk.span(events.SEND, k):
            self.prev.isend([g for g in input_grads if g is not None], k, p2p.BACKWARD)

    def complete_sends(self) -> None:
        """Wait until this step's sends have left (their buffers are reused next step)."""
        with self.walk.span(events.SEND), self.walk._guard("complete sends to pipeline neighbours"):
            for channel in (self.prev, self.next):
                if channel is not None:
                    channel.wait_sends()


class _SeedSnapshot:
    """Seed generator states at a step's start, put back before each micro-batch's forward, so
    that every piece draws from the seeds one full-batch call would draw from."""

    def __init__(self, variables: list):
        self.variables = variables
        self.values = [tf.identity(v.value) for v in variables]

    def restore(self) -> None:
        for variable, value in zip(self.variables, self.values, strict=True):
            variable.assign(value)


class _DeferredReceive:
    """A receive posted only when waited for: the blocking path (`overlap_p2p=False`)."""

    def __init__(self, channel, k: int, direction: str):
        self.channel, self.k, self.direction = channel, k, direction

    def wait(self, n: int):
        return self.channel.recv(self.k, self.direction, n)


def _as_tensors(structure):
    return tree.map_structure(lambda a: None if a is None else tf.convert_to_tensor(a), structure)
