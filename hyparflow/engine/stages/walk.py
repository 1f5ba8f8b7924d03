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
from hyparflow.engine.stages.structure import model_input_list
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


class Chunk(NamedTuple):
    """A part of the model a rank runs: its partitioner `stage` (None: the whole model, with no
    neighbours), its `runner`, whether it is the model's first and last part, and its random
    seed states (`seed_variables`). A rank runs one chunk, or several under the interleaved
    schedule."""

    stage: Any
    runner: Any
    is_first: bool
    is_last: bool
    seed_variables: tuple = ()


class PipelineWalk:
    """Runs one rank's actions (GPipe, 1F1B, ZB-H1, interleaved, forward-only) for a step's
    micro-batches.

    Cuts the replica's shard of a global batch into micro-batches, runs each forward and
    backward on the runner of the action's chunk (`chunks`, in model order), and moves
    activations and gradients to the neighbouring ranks over `PipeChannel`s (one pair per
    chunk, micro-batch size and count, kept for later steps). A chunk's link to the next part
    of the model uses its own communicator, so that two links between the same two ranks
    (interleaved, two stages) never match each other's messages.

    - `guard(operation, peer, microbatch)` watches each blocking wait; `span(kind,
      microbatch)` times each action (`events.Spans.span`).
    - `loss(y, y_pred, sample_weight)` and `update_metrics(...)` (compiled) serve evaluation
      and the metrics a runner does not update itself.
    - each chunk's `seed_variables` (its random seed states) are put back before each of its
      training forwards, so that every micro-batch draws from the step's seeds, as one
      full-batch call would.
    - `whole_inputs`: the first stage passes the user's `x` as is (an unpartitioned model of
      any structure), else as a list in `model.inputs` order.
    """

    def __init__(
        self, model, topology, strategy, chunks, *, guard, span, loss, update_metrics, whole_inputs
    ):
        self.model, self.topology, self.strategy = model, topology, strategy
        self.chunks = list(chunks)  # what this rank computes, and how
        self.is_first, self.is_last = topology.is_first_stage, topology.is_last_stage
        # one communicator per link between consecutive chunks of the model (collective)
        links = len(self.chunks) if self.chunks[0].stage is not None else 0
        self._comms = [topology.pipeline_comm] + [
            topology.pipeline_comm.Dup() for _ in range(1, links)
        ]
        self.guard = guard
        self._loss, self._update_metrics_fn = loss, update_metrics
        self._eval_loss_fn = None
        self.whole_inputs = whole_inputs
        self.span = span
        # (chunk, largest micro-batch, count) -> (prev, next)
        self.channels: dict[tuple, tuple] = {}
        self._schedules: dict[tuple, tuple] = {}  # (train, micro-batches) -> this stage's actions
        self.added_parts: list = []  # this step's (micro-batch size, added loss)

    def take_added(self) -> list:
        """The (micro-batch size, added loss) of each forward since the last call."""
        parts, self.added_parts = self.added_parts, []
        return parts

    def microbatches(self, batch: GlobalBatch) -> list[MicroBatch]:
        """This replica's shard of `batch` cut into micro-batches, as many on every replica
        (a last, smaller batch in fewer), so that collectives inside the step pair up."""
        topo = self.topology
        start, stop = split_bounds(batch.size, topo.num_replicas, topo.replica)
        shard = stop - start
        if shard == 0:
            return []
        x, y, sw = batch.part(start, stop)
        count = max(1, min(self.strategy.microbatches, batch.size // topo.num_replicas))
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
        self,
        microbatches: list[MicroBatch],
        global_size: int,
        *,
        train: bool,
        predict=False,
        loss_scale=1.0,
        on_segment_done=None,
        on_earlier_segment=None,
    ):
        """Walk this stage's actions for the micro-batches; return the last stage's results.

        `loss_scale` multiplies every training micro-batch's loss weight (at every stage:
        losses added in an earlier stage are scaled like the last stage's);
        `on_segment_done(j)`, if given, runs after each segment of the step's last backward,
        `on_earlier_segment(j)` after each segment of every other backward.
        """
        if not microbatches:
            return []
        step = _Step(self, microbatches, global_size, train=train, predict=predict)
        step.loss_scale = loss_scale
        actions = self._stage_actions(train, len(microbatches))
        backwards = [a.microbatch for a in actions if a.kind is ActionKind.BACKWARD]
        if backwards:
            # the step's last backward: every gradient of this stage is final after it
            step.last_backward = backwards[-1]
            step.on_segment_done, step.on_earlier_segment = on_segment_done, on_earlier_segment
        for action in actions:
            step.act(action)
        step.complete_sends()
        return step.results

    def close(self) -> None:
        for channels in self.channels.values():
            for channel in channels:
                if channel is not None:
                    channel.close()
        for comm in self._comms[1:]:
            comm.Free()
        self._comms = self._comms[:1]

    def links(self, chunk: int, max_microbatch: int, num_microbatches: int):
        """Chunk `chunk`'s channels to the previous and next part of the model, sized for
        micro-batches of this size."""
        key = (chunk, max_microbatch, num_microbatches)
        if key not in self.channels:
            topo, part = self.topology, self.chunks[chunk]
            # the link from model stage j to j + 1 uses communicator j // P (one per chunk)
            place = chunk * topo.num_stages + topo.stage

            def channel(peer, boundary, link):
                specs = [((max_microbatch, *t.shape), t.dtype) for t in boundary]
                floats = [s for s in specs if tf.as_dtype(s[1]).is_floating]  # carry gradients
                comm = self._comms[link // topo.num_stages]
                return PipeChannel(comm, peer, specs, num_microbatches, backward_specs=floats)

            prev = (
                None
                if part.is_first
                else channel(_pipeline_peer(topo, -1), part.stage.receives, place - 1)
            )
            nxt = (
                None if part.is_last else channel(_pipeline_peer(topo, 1), part.stage.sends, place)
            )
            self.channels[key] = (prev, nxt)
        return self.channels[key]

    def _stage_actions(self, train: bool, count: int) -> tuple:
        """This stage's actions, transfers included, for a step of `count` micro-batches
        (built and validated, every stage's with its transfers, once per count)."""
        key = (train, count)
        if key not in self._schedules:
            p, v = self.topology.num_stages, len(self.chunks)
            if train:
                schedule = make_schedule(self.strategy.schedule, p, count, v)
            else:
                schedule = forward_only(p, count, v)
            lowered = [with_transfers(actions, s, p, v) for s, actions in enumerate(schedule)]
            validate(lowered, count, training=train)
            self._schedules[key] = tuple(lowered[self.topology.stage])
        return self._schedules[key]

    def post_receives(self, links, count: int) -> dict:
        """The step's activation receives, posted up front so that transfers land while this
        stage computes (a gradient receive is posted when its activation leaves, by the
        schedule walk: at the first stage, posting them all here would delay its first forward,
        which every later stage waits for)."""
        return {
            (c, p2p.FORWARD, k): self.receive(prev, k, p2p.FORWARD)
            for c, (prev, _) in enumerate(links)
            if prev is not None
            for k in range(count)
        }

    def receive(self, channel, k: int, direction: str):
        """Micro-batch `k`'s receive from `channel`: posted now with `overlap_p2p`, else a
        blocking receive posted when waited for."""
        if self.strategy.overlap_p2p:
            return channel.irecv(k, direction)
        return _DeferredReceive(channel, k, direction)

    def finish_forward(self, runner, out, mb: MicroBatch, train: bool, predict: bool):
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
        if not (train and runner.updates_metrics):
            self._update_metrics_fn(y, y_pred, sw)
        return loss, mb.size


class _Step:
    """One step's walk at this stage: its channels, posted receives, the tensors between an
    action and the next that uses them, and the last stage's results. `act` runs one action
    (the walk's order); each kind of action has its method."""

    loss_scale = 1.0
    last_backward: int | None = None  # the micro-batch of the step's last backward
    on_segment_done = None  # after each segment of the last backward
    on_earlier_segment = None  # after each segment of the other backwards

    def __init__(self, walk: PipelineWalk, microbatches, global_size: int, *, train, predict):
        self.walk, self.microbatches, self.global_size = walk, microbatches, global_size
        self.train, self.predict = train, predict
        topo, count = walk.topology, len(microbatches)
        largest = max(m.size for m in microbatches)
        self.links = [  # per chunk: (previous, next) channel, None where there is none
            (None, None) if chunk.stage is None else walk.links(c, largest, count)
            for c, chunk in enumerate(walk.chunks)
        ]
        grid = topo.grid
        self.before = grid.rank_of(_pipeline_peer(topo, -1), topo.replica, topo.shard)
        self.after = grid.rank_of(_pipeline_peer(topo, 1), topo.replica, topo.shard)
        self.posted = walk.post_receives(self.links, count)
        # per chunk: a chunk's seeds, put back before each of its forwards, advance once a
        # step, as in one full-batch call, whatever the other chunks run in between
        self.seeds = [
            _SeedSnapshot(chunk.seed_variables) if train and count > 1 else None
            for chunk in walk.chunks
        ]
        self.results: list = []
        # (kind of the action that uses it, k, chunk) -> tensors
        self.held: dict[tuple, Any] = {}
        self._methods = {
            ActionKind.RECV_ACTIVATIONS: self.receive_activations,
            ActionKind.FORWARD: self.forward,
            ActionKind.SEND_ACTIVATIONS: self.send_activations,
            ActionKind.RECV_GRADIENTS: self.receive_gradients,
            ActionKind.BACKWARD: self.backward,
            ActionKind.WEIGHT: self.weight,
            ActionKind.SEND_GRADIENTS: self.send_gradients,
        }
        for chunk in walk.chunks:
            if train and not chunk.is_first and chunk.runner.flat_backward:
                # Pack while this stage waits for its first activations, off the critical path.
                with walk.span(events.FORWARD):
                    chunk.runner.prepare()

    def act(self, action) -> None:
        self._methods[action.kind](action.microbatch, action.chunk)

    def receive_activations(self, k: int, c: int) -> None:
        """Wait for micro-batch `k`'s inputs of chunk `c` from the previous stage."""
        received = self._wait(c, k, p2p.FORWARD, "receive activations", self.before)
        self.held[ActionKind.FORWARD, k, c] = received

    def forward(self, k: int, c: int) -> None:
        """Micro-batch `k`'s forward through chunk `c`, on its data (the model's first chunk)
        or received inputs."""
        walk, chunk = self.walk, self.walk.chunks[c]
        runner = chunk.runner
        mb = self.microbatches[k]
        if self.seeds[c] is not None:  # every micro-batch draws from the step's seeds
            self.seeds[c].restore()
        if chunk.is_first:
            inputs = mb.x if walk.whole_inputs else model_input_list(walk.model, mb.x)
        else:
            inputs = self.held.pop((ActionKind.FORWARD, k, c))
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
                walk.added_parts.append((mb.size, runner.last_added))
            if chunk.is_last:
                finished = walk.finish_forward(runner, out, mb, self.train, self.predict)
                self.results.append(finished)
            else:
                self.held[ActionKind.SEND_ACTIVATIONS, k, c] = out

    def send_activations(self, k: int, c: int) -> None:
        """Send micro-batch `k`'s outputs of chunk `c` to the next stage; in training, post the
        receive of their gradients (they cannot come back before the outputs have gone)."""
        walk, link = self.walk, self.links[c][1]
        with walk.span(events.SEND, k):
            link.isend(self.held.pop((ActionKind.SEND_ACTIVATIONS, k, c)), k, p2p.FORWARD)
            if self.train:
                self.posted[c, p2p.BACKWARD, k] = walk.receive(link, k, p2p.BACKWARD)

    def receive_gradients(self, k: int, c: int) -> None:
        """Wait for the gradients of micro-batch `k`'s outputs of chunk `c` from the next
        stage."""
        received = self._wait(c, k, p2p.BACKWARD, "receive gradients", self.after)
        self.held[ActionKind.BACKWARD, k, c] = received

    def _wait(self, c: int, k: int, direction: str, operation: str, peer):
        """Micro-batch `k`'s posted receive of chunk `c` in `direction` from `peer`, once it
        has landed."""
        walk = self.walk
        with walk.span(events.RECV, k), walk.guard(operation, peer, k):
            return self.posted.pop((c, direction, k)).wait(self.microbatches[k].size)

    def backward(self, k: int, c: int) -> None:
        """Micro-batch `k`'s backward through chunk `c`; `on_segment_done` (the step's last)
        or `on_earlier_segment` (the others; as for `PipelineWalk.run`) runs as each segment
        finishes."""
        walk, chunk = self.walk, self.walk.chunks[c]
        grads = self.held.pop((ActionKind.BACKWARD, k, c), None)  # None at the model's end
        hook = self.on_segment_done if k == self.last_backward else self.on_earlier_segment
        with walk.span(events.BACKWARD, k):
            if hook is not None:
                input_grads = chunk.runner.backward(k, grads, hook)
            else:
                input_grads = chunk.runner.backward(k, grads)
        if not chunk.is_first:
            self.held[ActionKind.SEND_GRADIENTS, k, c] = input_grads

    def weight(self, k: int, c: int) -> None:
        """Micro-batch `k`'s weight gradients in chunk `c`, where its backward left them
        (zero-bubble schedules)."""
        with self.walk.span(events.WEIGHT, k):
            self.walk.chunks[c].runner.weight(k)

    def send_gradients(self, k: int, c: int) -> None:
        """Send micro-batch `k`'s input gradients of chunk `c` back to the previous stage."""
        input_grads = self.held.pop((ActionKind.SEND_GRADIENTS, k, c))
        with self.walk.span(events.SEND, k):
            link = self.links[c][0]
            link.isend([g for g in input_grads if g is not None], k, p2p.BACKWARD)

    def complete_sends(self) -> None:
        """Wait until this step's sends have left (their buffers are reused next step)."""
        with self.walk.span(events.SEND), self.walk.guard("complete sends to pipeline neighbours"):
            for links in self.links:
                for channel in links:
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


def _pipeline_peer(topology, step: int) -> int:
    """The pipeline position `step` away from this rank's, around the ring (interleaved
    chunks pass from the last stage back to the first)."""
    return (topology.stage + step) % topology.num_stages


def _as_tensors(structure):
    return tree.map_structure(lambda a: None if a is None else tf.convert_to_tensor(a), structure)
