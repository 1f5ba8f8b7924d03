"""ZeRO-3 on a stage that is not cut into segments (a subclassed model): each layer gathers its
weights around its own call, inside the step's graph.

A stage the partitioner cannot cut runs as one compiled call, so the engine cannot gather
between segments (`ShardedWeights.gather_for`). Instead, while the call is traced, the model's
weights read from a `GatheringScope` (a `keras.StatelessScope`) that hands out a slice group's
all-gathered values the first time one of its variables is read, and each of the model's
direct layers that owns weights becomes a recompute boundary (FSDP's unit): its call runs as a
`tf.custom_gradient` whose forward computes on the layer's gathered weights and lets them go,
and whose backward gathers them again, recomputes the call under a tape and reduce-scatters
the weight gradients into this replica's slices (the all-gather's gradient). The step's
gradients so come out already summed over the replicas, as slices.

Each layer's slice group holds its variables (`layer_positions`); the variables no direct
layer owns (the model's own) form the last group, gathered where first read. The gathers run
on the weights' gather thread (`ShardedWeights.start_gather`), started by one op and waited
for by another, so that compute runs meanwhile: a layer's gather starts once the previous
layer's inputs exist (data edges), while that layer computes, and in the backward the
previous layer's gather starts as this layer's recomputation begins. A rank so holds one
layer's gathered weights and gradients and the next layer's weights in transfer, never all
of them. Both ops run in the graph's order of collectives (`comm/in_graph.py`), so every
replica's thread enters the all-gathers in one order, and no wait is pruned. The
recomputation replays the forward exactly: the same Keras call context (training), autocast
scope, random and statistics state (the values the forward read), and the runner's own
contexts (dropout rows of the global batch, synchronised statistics).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time

import numpy as np
import tensorflow as tf
from keras import tree

from hyparflow import _keras
from hyparflow.comm.background import BackgroundCollectives
from hyparflow.comm.in_graph import collective, in_order
from hyparflow.engine.sharded_optimizer.sharded_update import windowed_reduce_scatter
from hyparflow.engine.sharded_optimizer.sharded_weights import WAIT_TAG
from hyparflow.engine.stages.runner import UpdateRecordingScope
from hyparflow.intercept import replaced_calls

SCATTER_TAG = "gather/scatter"  # the layers' backward reduce-scatters of weight gradients
AHEAD_TAG = "gather/ahead"  # the gathers started for a layer while another one computes


def layer_positions(model, variables: list, dense: list[int]) -> list[list[int]]:
    """The `dense` positions of `variables` grouped by the model's direct layers that own them
    (each variable with the first layer that holds it), then those no direct layer holds; no
    group left empty."""
    where = {id(variables[i]): i for i in dense}
    groups, seen = [], set()
    for layer in _keras.all_layers(model, include_self=False, recursive=False):
        own = [where[id(v)] for v in layer.trainable_variables if id(v) in where]
        own = [i for i in dict.fromkeys(own) if i not in seen]
        seen.update(own)
        if own:
            groups.append(sorted(own))
    rest = [i for i in dense if i not in seen]
    return groups + ([rest] if rest else [])


class LayerGathering:
    """The in-graph gathers of a `ShardedWeights` whose groups are `layer_positions` of
    `model`'s `variables`, over `comm` (the stage's replicas); `guard(operation)` watches each
    wait, `traffic` (a `TrafficLog`) counts the waits for gathers (`WAIT_TAG`; the weights'
    gather thread counts the gathers) and the reduce-scatters (`SCATTER_TAG`).

    Example:
        gathering = LayerGathering(model, weights, comm, guard, traffic)
        with gathering.reading(slices, replay):  # inside the trace of the stage's call
            outputs = model(x, training=True)
    """

    def __init__(self, model, weights, comm, guard, traffic):
        self.weights, self.comm, self._guard = weights, comm, guard
        self.groups = weights.groups
        self._waits, self._scatters = traffic.of(WAIT_TAG), traffic.of(SCATTER_TAG)
        self._ahead = traffic.of(AHEAD_TAG)
        self._group_of = {}
        for g, group in enumerate(self.groups):
            for i in group.positions:
                self._group_of[id(weights.variables[i])] = g
        owners = _keras.all_layers(model, include_self=False, recursive=False)
        self.layers = [layer for layer in owners if self.groups_of(layer)]
        self._started = {}  # ticket -> the future of a gather started and not waited for yet
        self._tickets = itertools.count()

    def groups_of(self, layer) -> list[int]:
        """The slice groups holding `layer`'s trainable variables, in order."""
        found = {self._group_of.get(id(v)) for v in layer.trainable_variables}
        return sorted(found - {None})

    def group_of(self, variable) -> int | None:
        """The slice group holding `variable`, None where it is not sliced (a table)."""
        return self._group_of.get(id(variable))

    def slices(self) -> list:
        """This replica's slice of each group, now (the step's graph reads them as inputs)."""
        return [group.variable.value for group in self.groups]

    @contextlib.contextmanager
    def reading(self, slices: list, replay=contextlib.nullcontext):
        """Inside a trace: the sliced variables read values gathered from `slices` (one tensor
        per group) where first read, each direct layer owning weights runs as a boundary
        (recomputing its call in the backward under `replay()`, the caller's contexts), and
        what the call assigns to any variable is assigned after."""
        scope = GatheringScope(self, slices, replay=replay)
        calls = replaced_calls(
            (layer, lambda call, layer=layer: self._bounded(layer, call)) for layer in self.layers
        )
        with calls, scope:
            yield
        scope.assign_updates()

    def start(self, g: int, slice_tensor, after: list, ahead: bool = False):
        """Inside a trace: start all-gathering group g from every replica's `slice_tensor` on
        the gather thread once the tensors `after` exist, in the graph's order of
        collectives; a ticket for `finish`. `ahead`: `after` are another layer's tensors
        (counted under `AHEAD_TAG`)."""

        def submit(mine, *ignored):
            if ahead:
                self._ahead.record(0.0, 0.0, 0)
            ticket = next(self._tickets)
            # a copy: TensorFlow may reuse the input's buffer once this op returns
            self._started[ticket] = self.weights.start_gather(g, np.array(mine, copy=True))
            return np.int64(ticket)

        return in_order(submit, [slice_tensor, *_tokens(after)], tf.int64, [])

    def finish(self, g: int, ticket, after: list = ()):
        """Inside a trace: group g's whole padded flat vector, from the gather `ticket` started
        (`start`), waited for once the tensors `after` exist; the wait is the part of the
        gather that compute did not hide."""
        group = self.groups[g]

        def wait(number, *ignored):
            future = self._started.pop(int(number))
            begin = time.perf_counter()
            with self._guard("all-gather a layer's weights over the replicas"):
                whole = BackgroundCollectives.wait(future)
            self._waits.record(begin, time.perf_counter(), 0)
            return whole

        # in the order of collectives too: a later one takes its output, so no wait is pruned
        # where nothing reads the weights (a first layer's recomputation), which would leave
        # its gather started and never taken
        inputs = [ticket, *_tokens(after)]
        return in_order(wait, inputs, tf.as_dtype(group.dtype), [group.layout.padded])

    def gathered(self, g: int, slice_tensor, whole) -> list:
        """Group g's variables' values out of `whole` (its padded flat vector, every replica's
        `slice_tensor` gathered: `finish`), differentiable in `slice_tensor` (the gradient is
        reduce-scattered)."""
        group = self.groups[g]
        whole = self._differentiable_gather(g)(slice_tensor, whole)
        layout = group.layout
        return [
            tf.reshape(
                whole[layout.offsets[j] : layout.offsets[j] + layout.sizes[j]],
                self.weights.variables[i].shape,
            )
            for j, i in enumerate(group.positions)
        ]

    def _differentiable_gather(self, g: int):
        group = self.groups[g]

        @tf.custom_gradient
        def gather(slice_tensor, whole):
            def scatter(upstream):
                return self._reduce_scattered(group, upstream), None

            return tf.identity(whole), scatter

        return gather

    def _reduce_scattered(self, group, upstream):
        """This replica's slice of the sum over the replicas of `upstream` (the gradient of the
        group's padded whole vector), in the group's dtype."""
        wire = group.reduced_dtype

        def scatter(whole):
            views = [
                whole[group.layout.offsets[j] : group.layout.offsets[j] + size]
                for j, size in enumerate(group.layout.sizes)
            ]
            return windowed_reduce_scatter(self.comm, group, views, 1.0, self._guard)

        upstream = tf.cast(tf.convert_to_tensor(upstream), wire)
        sliced = collective(
            scatter,
            [upstream],
            tf.as_dtype(wire),
            [group.layout.slice_size],
            self._scatters,
            group.reduce_scatter_bytes,
        )
        return tf.cast(sliced, group.dtype)

    def _bounded(self, layer, call):
        """What stands for `layer.call` while a call is traced: a recompute boundary where the
        current scope gathers (and none is open yet), else the call itself."""

        def bounded(*args, **kwargs):
            scope = _keras.current_stateless_scope()
            if not isinstance(scope, GatheringScope) or scope.inside_boundary:
                return call(*args, **kwargs)
            return _Boundary(self, layer, call, scope).run(args, kwargs)

        return bounded


class GatheringScope(UpdateRecordingScope):
    """A `keras.StatelessScope` whose sliced variables read values all-gathered from `slices`
    (one tensor per group of `gathering`) where first read: from `ready` (group -> what
    returns its gathered padded flat vector: a gather started ahead), else gathered then,
    once the tensors `after` exist; variables it does not map read `parent`'s values (None:
    their own). `mapping` gives variables values up front (a boundary's replayed state);
    `inside_boundary`: a boundary's scope, in which layers' calls are not bounded again.
    `last_boundary`: the boundary that ran last in this scope (the next one's gathers start
    as that one's call begins)."""

    def __init__(
        self,
        gathering: LayerGathering,
        slices: list,
        *,
        after=(),
        ready=None,
        parent=None,
        mapping=(),
        inside_boundary=False,
        replay=contextlib.nullcontext,
    ):
        super().__init__(mapping)
        self.gathering, self.slices, self.after = gathering, list(slices), list(after)
        self.ready = dict(ready or {})
        self.parent, self.inside_boundary, self.replay = parent, inside_boundary, replay
        self.last_boundary = None

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        if value is not None:
            return value
        g = self.gathering.group_of(variable)
        if g is None:
            return None if self.parent is None else self.parent.get_current_value(variable)
        self._read(g)
        return self.state_mapping[id(variable)]

    def settle(self) -> None:
        """Take what `ready` holds that no read took: every gather started is waited for."""
        for g in list(self.ready):
            self._read(g)

    def _read(self, g: int) -> None:
        gathering, slice_tensor = self.gathering, self.slices[g]
        take = self.ready.pop(g, None)
        if take is None:
            whole = gathering.finish(g, gathering.start(g, slice_tensor, self.after))
        else:
            whole = take()
        group = gathering.groups[g]
        values = gathering.gathered(g, slice_tensor, whole)
        for i, gathered in zip(group.positions, values, strict=True):
            self.state_mapping[id(gathering.weights.variables[i])] = gathered


class _Boundary:
    """One traced call of a direct layer under a `GatheringScope` (`outer`): FSDP's unit.
    Its gathers start as the previous boundary's call begins (`previous`), and in the backward
    it starts the previous boundary's while it recomputes, handing the gathered vectors over
    (`ahead`)."""

    def __init__(self, gathering: LayerGathering, layer, call, outer: GatheringScope):
        self.gathering, self.layer, self.call, self.outer = gathering, layer, call, outer
        self.groups = gathering.groups_of(layer)
        self.state = _state_variables(layer)
        self.keras_state = _keras.call_state()
        self.previous, outer.last_boundary = outer.last_boundary, self
        self.inputs = []  # the call's float inputs, once it runs
        self.ahead = {}  # group -> its padded flat vector, gathered for the backward ahead
        self.backward_built = False
        # what the traced forward made: its outputs' structure, the layers that added losses
        self._structure, self._loss_owners = None, []

    def run(self, args, kwargs):
        flat = tree.flatten((args, kwargs))
        floats = [k for k, t in enumerate(flat) if _is_float_tensor(t)]
        self.inputs = [flat[k] for k in floats]
        # the state the forward reads, replayed by the recomputation: `outer`'s values (what
        # an earlier call assigned), in the variables' own dtype (no autocast)
        state_values = [self._current(v) for v in self.state]
        count = len(floats)
        # this layer's gathers start as the previous layer's call begins
        previous = self.previous
        if previous is None:
            tickets = self.start_gathers(self.inputs, ahead=False)
        else:
            tickets = self.start_gathers(previous.inputs, ahead=True)

        def rebuilt(inputs):
            items = list(flat)
            for k, tensor in zip(floats, inputs, strict=True):
                items[k] = tensor
            return tree.pack_sequence_as((args, kwargs), items)

        @tf.custom_gradient
        def bounded(*tensors):
            inputs, slices = tensors[:count], tensors[count:]
            outputs, losses = self._forward(rebuilt, inputs, slices, tickets)

            def backward(*upstream, variables=None):
                return self._backward(rebuilt, inputs, slices, state_values, upstream, variables)

            return [*tree.flatten(outputs), *losses], backward

        results = bounded(*self.inputs, *self.outer.slices)
        outputs_count = len(results) - len(self._loss_owners)
        for owner, loss in zip(self._loss_owners, results[outputs_count:], strict=True):
            self.outer.add_loss(loss)
            _keras.own_loss(owner, loss)
        return tree.pack_sequence_as(self._structure, results[:outputs_count])

    def start_gathers(self, after: list, ahead: bool) -> dict:
        """The tickets of this layer's gathers, started once the tensors `after` exist
        (`ahead`: another layer's)."""
        slices = self.outer.slices
        return {g: self.gathering.start(g, slices[g], after, ahead) for g in self.groups}

    def _current(self, variable):
        value = self.outer.get_current_value(variable)
        return tf.convert_to_tensor(_keras.stored_value(variable) if value is None else value)

    def _scope(self, slices, after, **options) -> GatheringScope:
        return GatheringScope(self.gathering, slices, after=after, inside_boundary=True, **options)

    def _forward(self, rebuilt, inputs, slices, tickets: dict) -> tuple:
        """The call on gathered weights (`tickets`: its gathers started); its assignments
        handed to the outer scope; (outputs, the losses its layers added)."""
        finish = self.gathering.finish
        ready = {g: functools.partial(finish, g, ticket) for g, ticket in tickets.items()}
        scope = self._scope(slices, inputs, parent=self.outer, ready=ready)
        with scope:
            args, kwargs = rebuilt(inputs)
            outputs = self.call(*args, **kwargs)
            owned = self._added_losses()
            scope.settle()
        for update in scope.updates.values():
            self.outer.add_update(update)
        self._structure = outputs
        self._loss_owners = [owner for owner, _ in owned]
        return outputs, [loss for _, loss in owned]

    def _added_losses(self) -> list:
        """(layer, loss) of each loss the layer and its sublayers added in the current scope."""
        return [
            (owner, loss)
            for owner in _keras.all_layers(self.layer)
            for loss in _keras.own_losses(owner)
        ]

    def _backward(self, rebuilt, inputs, slices, state_values, upstream, variables):
        """The boundary's gradients: the weights gathered again (ahead, by the next boundary's
        backward, or once the upstream gradients exist), the call recomputed under a tape
        from the forward's state, differentiated; meanwhile the previous boundary's gathers
        run, for its own backward."""
        self.backward_built = True
        previous = self.previous
        if previous is not None and not previous.backward_built:
            tickets = previous.start_gathers(list(upstream), ahead=True)
        else:
            previous, tickets = None, {}
        variables = list(variables or [])
        ready = {g: (lambda whole=whole: whole) for g, whole in self.ahead.items()}
        grads = self._recomputed_gradients(
            rebuilt, inputs, slices, state_values, upstream, ready, variables
        )
        if previous is not None:
            done = [g for g in grads[: len(inputs)] if g is not None] or list(upstream)
            previous.ahead = {g: self.gathering.finish(g, t, done) for g, t in tickets.items()}
        count = len(inputs) + len(slices)
        if variables:
            return grads[:count], grads[count:]
        return grads[:count]

    def _recomputed_gradients(
        self, rebuilt, inputs, slices, state_values, upstream, ready, variables
    ):
        """The gradients of the recomputed call's outputs (`upstream` theirs) with respect to
        `inputs`, `slices` and `variables`, its weights read from `ready` where given."""
        mapping = list(zip(self.state, state_values, strict=True))
        with (
            _keras.calling_under(self.keras_state),
            self.outer.replay(),
            tf.GradientTape(watch_accessed_variables=False) as tape,
        ):
            tape.watch([*inputs, *slices, *variables])
            with self._scope(slices, list(upstream), mapping=mapping, ready=ready):
                args, kwargs = rebuilt(inputs)
                outputs = self.call(*args, **kwargs)
                losses = [loss for _, loss in self._added_losses()]
        results = [*tree.flatten(outputs), *losses]
        pairs = [(r, u) for r, u in zip(results, upstream, strict=True) if u is not None]
        pairs = [(r, u) for r, u in pairs if r.dtype.is_floating]
        return tape.gradient(
            [r for r, _ in pairs],
            [*inputs, *slices, *variables],
            output_gradients=[u for _, u in pairs],
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )


def _is_float_tensor(value) -> bool:
    return tf.is_tensor(value) and value.dtype.is_floating


def _state_variables(layer) -> list:
    """What a call of `layer` may read and change besides its weights: its non-trainable
    variables (statistics) and its seed generators' states."""
    found = {id(v): v for v in layer.non_trainable_variables}
    for sub in _keras.all_layers(layer):
        for generator in _keras.seed_generators(sub):
            found.setdefault(id(generator.state), generator.state)
    return list(found.values())


def _tokens(tensors) -> list:
    """One element of each of `tensors` (an op taking them waits for them all, copying little)."""
    return [tf.reshape(t, [-1])[:1] for t in tensors if t is not None]
