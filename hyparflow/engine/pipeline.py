"""The pipeline walk: a stage's micro-batches through its schedule's actions and its channels."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow.comm.p2p import BACKWARD, FORWARD, PipeChannel
from hyparflow.data import GlobalBatch, piece_bounds
from hyparflow.engine import events
from hyparflow.engine.schedule import forward_only, make_schedule
from hyparflow.engine.structure import model_input_list


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

    def microbatches(self, batch: GlobalBatch) -> list:
        """This replica's shard of `batch` cut into micro-batches: [(x, y, sw, size, offset)],
        offset being where the micro-batch starts in the global batch."""
        topo = self.topology
        start, stop = piece_bounds(batch.size, topo.num_replicas, topo.replica)
        shard = stop - start
        if shard == 0:
            return []
        x, y, sw = batch.part(start, stop)
        count = min(self.strategy.microbatches, shard)
        pieces = []
        for k in range(count):
            a, b = piece_bounds(shard, count, k)
            cut = slice(a, b)
            pieces.append(
                (
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
        return pieces

    def run(
        self, pieces, global_size: int, *, train: bool, predict=False, loss_scale=1.0,
        on_segment_done=None,
    ):  # fmt: skip
        """Walk this stage's actions for the micro-batches; return the last stage's results.

        `loss_scale` multiplies every training micro-batch's loss weight (at every stage:
        losses added in an earlier stage are scaled like the last stage's);
        `on_segment_done(j)`, if given, runs after each segment of the step's last backward.
        """
        if not pieces:
            return []
        topo = self.topology
        count = len(pieces)
        if self.stage is None:
            prev = nxt = None
        else:
            prev, nxt = self._links(max(piece[3] for piece in pieces), count)
        actions = self._stage_actions(train, count)
        guard, span, runner = self._guard, self.span, self.runner
        grid = topo.grid
        before = (
            grid.rank_of(topo.stage - 1, topo.replica, topo.shard) if not self.is_first else None
        )
        after = grid.rank_of(topo.stage + 1, topo.replica, topo.shard) if not self.is_last else None
        posted = self._post_receives(prev, count)
        seeds = _SeedSnapshot(self._seed_variables) if train and count > 1 else None
        if train and not self.is_first and runner.flat_backward:
            # Pack while this stage waits for its first activations, off the critical path.
            with span(events.FORWARD):
                runner.prepare()
        results = []
        final_backward = max(
            (i for i, a in enumerate(actions) if not a.is_forward), default=-1
        )  # the step's last backward: every gradient of this stage is final after it
        for index, action in enumerate(actions):
            k = action.microbatch
            x, y, sw, n, offset = pieces[k]
            if action.is_forward:
                if seeds is not None:  # every micro-batch draws from the step's seeds
                    seeds.restore()
                if self.is_first:
                    inputs = x if self._whole_inputs else model_input_list(self.model, x)
                else:
                    with span(events.RECV, k), guard("receive activations", before, k):
                        inputs = posted.pop((FORWARD, k)).wait(n)
                with span(events.FORWARD, k):
                    if train:
                        out = runner.forward(
                            k,
                            inputs,
                            (y, sw),
                            scale=n / global_size * loss_scale,
                            piece=(offset, global_size),
                        )
                    else:
                        out = runner.infer(inputs)
                    if not predict:
                        self._added_parts.append((n, runner.last_added))
                    if self.is_last:
                        results.append(self._finish_forward(out, y, sw, n, train, predict))
                if not self.is_last:
                    with span(events.SEND, k):
                        nxt.isend(out, k, FORWARD)
                        if train:  # its gradients cannot come back before it has gone
                            posted[BACKWARD, k] = self._receive(nxt, k, BACKWARD)
            else:
                grads = None
                if not self.is_last:
                    with span(events.RECV, k), guard("receive gradients", after, k):
                        grads = posted.pop((BACKWARD, k)).wait(n)
                with span(events.BACKWARD, k):
                    if on_segment_done is not None and index == final_backward:
                        input_grads = runner.backward(k, grads, on_segment_done)
                    else:
                        input_grads = runner.backward(k, grads)
                if not self.is_first:
                    with span(events.SEND, k):
                        prev.isend([g for g in input_grads if g is not None], k, BACKWARD)
        with span(events.SEND), guard("complete sends to pipeline neighbours"):
            for channel in (prev, nxt):
                if channel is not None:
                    channel.wait_sends()
        return results

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

    def _finish_forward(self, out, y, sw, n, train, predict):
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
        return loss, n


class _SeedSnapshot:
    """Seed generator states at a step's start, put back before each micro-batch's forward, so
    that every piece draws from the seeds one full-batch call would draw from."""

    def __init__(self, variables: list):
        self.variables = variables
        self.values = [tf.identity(v.value) for v in variables]

    def restore(self) -> None:
        for variable, value in zip(self.variables, self.values):
            variable.assign(value)


class _DeferredReceive:
    """A receive posted only when waited for: the blocking path (`overlap_p2p=False`)."""

    def __init__(self, channel, k: int, direction: str):
        self.channel, self.k, self.direction = channel, k, direction

    def wait(self, n: int):
        return self.channel.recv(self.k, self.direction, n)


def _as_tensors(structure):
    return tree.map_structure(lambda a: None if a is None else tf.convert_to_tensor(a), structure)
