"""The pipeline walk: a stage's micro-batches through its schedule's actions and its channels."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow.comm.p2p import BACKWARD, FORWARD, PipeChannel
from hyparflow.data import GlobalBatch, piece_bounds
from hyparflow.engine import events
from hyparflow.engine.structure import model_input_list
from hyparflow.schedule import forward_only, make_schedule


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
    """Runs one stage's actions (GPipe, 1F1B, forward-only) for a step's micro-batches.

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
        self.model = model
        self.topology = topology
        self.strategy = strategy
        self.stage = stage
        self.runner = runner
        self.is_first, self.is_last = topology.is_first_stage, topology.is_last_stage
        self._guard = guard
        self._loss = loss
        self._eval_loss_fn = None
        self._update_metrics_fn = update_metrics
        self._seed_variables = seed_variables
        self._whole_inputs = whole_inputs
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
        start, stop = piece_bounds(batch.size, topo.num_replicas, topo.replica)
        shard = stop - start
        if shard == 0:
            return []
        x, y, sw = batch.part(start, stop)
        count = min(self.strategy.microbatches, shard)
        microbatches = []
        for k in range(count):
            a, b = piece_bounds(shard, count, k)
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
        final_backward = max(
            (i for i, a in enumerate(actions) if not a.is_forward), default=-1
        )  # the step's last backward: every gradient of this stage is final after it
        for index, action in enumerate(actions):
            if action.is_forward:
                step.forward(action.microbatch)
            else:
                last = on_segment_done if index == final_backward else None
                step.backward(action.microbatch, on_segment_done=last)
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
        """This stage's actions for a step of `count` micro-batches (built once per count)."""
        key = (train, count)
        if key not in self._schedules:
            topo = self.topology
            if train:
                schedule = make_schedule(self.strategy.schedule, topo.num_stages, count)
            else:
                schedule = forward_only(topo.num_stages, count)
            self._schedules[key] = tuple(schedule[topo.stage])
        return self._schedules[key]

    def _post_receives(self, prev, count: int) -> dict:
        """The step's activation receives, posted up front so that transfers land while this
        stage computes (a gradient receive is posted when its activation leaves, by the
        schedule walk: at the first stage, posting them all here would delay its first forward,
        which every later stage waits for)."""
        if prev is None:
            return {}
        return {(FORWARD, k): self._receive(prev, k, FORWARD) for k in range(count)}

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
                self._eval_loss_fn = tf.function(self._loss)
            loss = self._eval_loss_fn(y, y_pred, sw)
        if not (train and self.runner.updates_metrics):
            self._update_metrics_fn(y, y_pred, sw)
        return loss, mb.size


class _Step:
    """One step's walk at this stage: its channels, posted receives and the last stage's
    results; `forward` and `backward` run one action each (the walk's order)."""

    loss_scale = 1.0

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
        if train and not walk.is_first and walk.runner.flat_backward:
            # Pack while this stage waits for its first activations, off the critical path.
            with walk.span(events.FORWARD):
                walk.runner.prepare()

    def forward(self, k: int) -> None:
        """Micro-batch `k`'s forward: receive its activations, run, send them on."""
        walk, span, runner = self.walk, self.walk.span, self.walk.runner
        mb = self.microbatches[k]
        if self.seeds is not None:  # every micro-batch draws from the step's seeds
            self.seeds.restore()
        if walk.is_first:
            inputs = mb.x if walk._whole_inputs else model_input_list(walk.model, mb.x)
        else:
            with span(events.RECV, k), walk._guard("receive activations", self.before, k):
                inputs = self.posted.pop((FORWARD, k)).wait(mb.size)
        with span(events.FORWARD, k):
            if self.train:
                out = runner.forward(
                    k,
                    inputs,
                    (mb.y, mb.sample_weight),
                    scale=mb.size / self.global_size * self.loss_scale,
                    piece=(mb.offset, self.global_size),
                )
            else:
                out = runner.infer(inputs)
            if not self.predict:
                walk._added_parts.append((mb.size, runner.last_added))
            if walk.is_last:
                self.results.append(walk._finish_forward(out, mb, self.train, self.predict))
        if not walk.is_last:
            with span(events.SEND, k):
                self.next.isend(out, k, FORWARD)
                if self.train:  # its gradients cannot come back before it has gone
                    self.posted[BACKWARD, k] = walk._receive(self.next, k, BACKWARD)

    def backward(self, k: int, *, on_segment_done=None) -> None:
        """Micro-batch `k`'s backward: receive its output gradients, run, send the input
        gradients back; `on_segment_done` (the step's last backward only) as for `run`."""
        walk, span = self.walk, self.walk.span
        grads = None
        if not walk.is_last:
            with span(events.RECV, k), walk._guard("receive gradients", self.after, k):
                grads = self.posted.pop((BACKWARD, k)).wait(self.microbatches[k].size)
        with span(events.BACKWARD, k):
            if on_segment_done is not None:
                input_grads = walk.runner.backward(k, grads, on_segment_done)
            else:
                input_grads = walk.runner.backward(k, grads)
        if not walk.is_first:
            with span(events.SEND, k):
                self.prev.isend([g for g in input_grads if g is not None], k, BACKWARD)

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
