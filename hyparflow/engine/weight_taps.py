"""Weight taps: a stage's backward split into its input half now and its weight half later.

Zero Bubble Pipeline Parallelism (Qi et al., ICLR 2024) splits a stage's backward into B, the
gradient of its inputs, which the previous stage waits for, and W, the gradient of its
weights, which only the optimizer step waits for. A TensorFlow function called under a tape
has one backward that computes both, so the split is made at the layers:

- While the taped forward is traced, `Taps` reads the stage's weights as constants and adds,
  to each float output of every call of a layer that owns weights, a slice of one zero vector
  (the taps). It records each call: the layer, its arguments (the tensors among them become
  outputs of the forward) and its outputs' shapes.
- B is the tape's gradient of the stage's inputs and of the taps: the taps' gradient holds
  each call's output gradient. No weight gradient is computed.
- W (`weight_gradients`) calls each recorded layer again on its saved arguments and
  differentiates its outputs with respect to the layer's own weights, given that output
  gradient. Grappler prunes what the weight gradient does not read (a linear layer's product).

`Taps.refusals` says why a stage cannot be split this way, and the stage then runs a merged
backward: a weight read outside its owner's call (e.g. a tied embedding read by another
layer), a layer called inside a loop or nested function (an RNN's cell), a layer with random
draws, one that adds a loss or runs in another dtype than float32, or whose outputs vary in
more than their first (batch) dimension.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import keras
import tensorflow as tf
from keras import tree

from hyparflow import _keras
from hyparflow.engine.stage import UpdateRecordingScope


@dataclass
class LayerCall:
    """One call of a layer that owns weights, as the forward's trace made it: `args` and
    `kwargs` with each tensor replaced by its position in the saved tensors, and the shapes of
    its float outputs (first dimension the batch's, else fixed)."""

    layer: object
    args: tuple
    kwargs: dict
    saved: int  # how many tensors of the saved list are this call's
    output_shapes: list = field(default_factory=list)


class _Slot:
    """Where a saved tensor goes back into a call's arguments."""

    def __init__(self, index: int):
        self.index = index


def _is_tensor(value) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable)) or tf.is_tensor(value)


def weight_owners(layers, variables) -> dict[int, object]:
    """id(variable) -> the layer of `layers` that created it, for each of `variables`."""
    wanted = {id(v) for v in variables}
    owners = {}
    for layer in layers:
        for variable in _keras.own_trainable_variables(layer):
            if id(variable) in wanted:
                owners[id(variable)] = layer
    return owners


class _ReadScope(UpdateRecordingScope):
    """A `keras.StatelessScope` reading the stage's weights as constants, noting any read that
    happens outside a call of the weight's owner."""

    def __init__(self, owners: dict, active: list, refusals: list):
        super().__init__([])
        self.owners, self.active, self.refusals = owners, active, refusals

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        owner = self.owners.get(id(variable))
        if value is not None or owner is None:
            return value
        if not any(layer is owner for layer in self.active):
            self.refusals.append(
                f"weight {variable.path} is read outside a call of its layer {owner.name}"
            )
        return tf.stop_gradient(tf.convert_to_tensor(_keras.stored_value(variable)))


class Taps:
    """Trace-time recorder of the calls of weight-owning layers (see the module docstring).

    Use inside the traced forward, around the stage's call:
        taps = Taps(owners, tap_vector)
        with taps:
            outputs = call(inputs)
        saved, end = taps.saved, taps.offset  # outputs of the forward

    After the trace, `calls` lists the recorded calls in order, `refusals` why the stage
    cannot be split (empty: it can), and `updates` the assignments the layers made (the
    caller applies them, as `UpdateRecordingScope`'s).
    """

    def __init__(self, owners: dict, taps):
        self.owners = owners
        self.layers = list({id(layer): layer for layer in owners.values()}.values())
        self.taps = taps
        self.calls: list[LayerCall] = []
        self.saved: list = []
        self.refusals: list[str] = []
        self.offset = tf.zeros((), tf.int32)
        self._active: list = []
        self._stack = contextlib.ExitStack()

    @property
    def updates(self) -> dict:
        return self._scope.updates

    def __enter__(self):
        self._graph = tf.compat.v1.get_default_graph()
        self._scope = _ReadScope(self.owners, self._active, self.refusals)
        for layer in self.layers:
            self._patch(layer)
        self._stack.enter_context(self._scope)
        return self

    def __exit__(self, *exc):
        self._stack.close()
        for layer in self.layers:
            object.__delattr__(layer, "call")
        return False

    def _patch(self, layer) -> None:
        if "call" in vars(layer):
            raise RuntimeError(f"layer {layer.name} already has its own `call` attribute")
        original = type(layer).call.__get__(layer)

        def tapped(*args, **kwargs):
            return self._tapped_call(layer, original, args, kwargs)

        object.__setattr__(layer, "call", tapped)

    def _refuse_layer(self, layer) -> bool:
        """Record why `layer`'s calls cannot be replayed for its weight gradient, if they
        cannot; True then."""
        reasons = []
        if tf.compat.v1.get_default_graph() is not self._graph:
            reasons.append(f"layer {layer.name} is called inside a loop or nested function")
        if _keras.seed_generators(layer):
            reasons.append(f"layer {layer.name} draws random numbers")
        if layer.compute_dtype != "float32" or any(
            v.dtype != "float32" for v in _keras.own_trainable_variables(layer)
        ):
            reasons.append(f"layer {layer.name} computes in {layer.compute_dtype}, not float32")
        self.refusals.extend(reasons)
        return bool(reasons)

    def _tapped_call(self, layer, original, args, kwargs):
        if self._refuse_layer(layer):
            return original(*args, **kwargs)
        losses_before = len(_keras.own_losses(layer))
        self._active.append(layer)
        try:
            outputs = original(*args, **kwargs)
        finally:
            self._active.pop()
        if len(_keras.own_losses(layer)) != losses_before:
            self.refusals.append(f"layer {layer.name} adds a loss in its call")
        record = self._record(layer, args, kwargs)
        return tree.map_structure(lambda t: self._tap(t, record), outputs)

    def _record(self, layer, args, kwargs) -> LayerCall:
        start = len(self.saved)

        def keep(value):
            if not _is_tensor(value):
                return value
            self.saved.append(tf.convert_to_tensor(value))
            return _Slot(len(self.saved) - 1 - start)

        call = LayerCall(
            layer,
            tree.map_structure(keep, args),
            tree.map_structure(keep, kwargs),
            saved=0,
        )
        call.saved = len(self.saved) - start
        self.calls.append(call)
        return call

    def _tap(self, tensor, call: LayerCall):
        """`tensor` plus the next slice of the taps (float tensors only)."""
        if not _is_tensor(tensor) or not tensor.dtype.is_floating:
            return tensor
        shape = tensor.shape
        if shape.rank is None or any(d is None for d in shape[1:]):
            self.refusals.append(
                f"layer {call.layer.name}'s output {shape} varies beyond its batch dimension"
            )
            return tensor
        call.output_shapes.append(tuple(shape))
        size = tf.size(tensor, out_type=tf.int32)
        piece = tf.reshape(self.taps[self.offset : self.offset + size], tf.shape(tensor))
        self.offset = self.offset + size
        tapped = tensor + tf.cast(piece, tensor.dtype)
        mask = _keras.keras_mask(tensor)
        if mask is not None:
            _keras.set_keras_mask(tapped, mask)
        return tapped


def tap_size(calls: list[LayerCall], rows: int) -> int:
    """Elements of the taps a forward of `rows` rows needs (sum of the tapped outputs)."""
    total = 0
    for call in calls:
        for shape in call.output_shapes:
            rest = math.prod(shape[1:])
            total += rest * (rows if shape[0] is None else shape[0])
    return total


def weight_gradients(calls: list[LayerCall], variables: list, saved, output_grads):
    """Each variable's gradient (None where no call reads it), in `variables`' order: every
    call of `calls` replayed on its `saved` arguments and differentiated with respect to its
    layer's own weights, given its outputs' gradients (`output_grads`, the taps' gradient).
    Call inside a trace."""
    positions = {id(v): i for i, v in enumerate(variables)}
    grads: list[list] = [[] for _ in variables]
    offset, start = tf.zeros((), tf.int32), 0
    for call in calls:
        mine = saved[start : start + call.saved]
        start += call.saved
        restore = lambda v, mine=mine: mine[v.index] if isinstance(v, _Slot) else v  # noqa: E731
        args = tree.map_structure(restore, call.args)
        kwargs = tree.map_structure(restore, call.kwargs)
        own = [v for v in _keras.own_trainable_variables(call.layer) if id(v) in positions]
        sources = [getattr(v, "value", v) for v in own]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(sources)
            # what the replay assigns (BatchNormalization's statistics) is dropped
            with keras.StatelessScope(initialize_variables=False):
                outputs = type(call.layer).call(call.layer, *args, **kwargs)
        floats = [t for t in tree.flatten(outputs) if _is_tensor(t) and t.dtype.is_floating]
        pieces = []
        for tensor in floats:
            size = tf.size(tensor, out_type=tf.int32)
            piece = tf.reshape(output_grads[offset : offset + size], tf.shape(tensor))
            pieces.append(tf.cast(piece, tensor.dtype))
            offset = offset + size
        found = tape.gradient(
            floats, sources, output_gradients=pieces,
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )  # fmt: skip
        for variable, grad in zip(own, found, strict=True):
            if grad is not None:
                grads[positions[id(variable)]].append(grad)
    return [_summed(parts) for parts in grads]


def _summed(parts: list):
    """One variable's gradient from its calls' parts: row slices stay row slices."""
    if not parts:
        return None
    if all(isinstance(p, tf.IndexedSlices) for p in parts):
        if len(parts) == 1:
            return parts[0]
        return tf.IndexedSlices(
            tf.concat([p.values for p in parts], 0),
            tf.concat([p.indices for p in parts], 0),
            parts[0].dense_shape,
        )
    return tf.add_n([tf.convert_to_tensor(p) for p in parts])
