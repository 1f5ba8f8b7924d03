"""Weight taps: a stage's backward split into its input half now and its weight half later.

Zero Bubble Pipeline Parallelism (Qi et al., ICLR 2024) splits a stage's backward into B, the
gradient of its inputs, which the previous stage waits for, and W, the gradient of its
weights, which only the optimizer step waits for. A TensorFlow function called under a tape
has one backward that computes both, so the split is made at the layers:

- A first trace (discovery, `taps=None`) records each call of a layer that owns weights: the
  layer, its arguments and its float outputs' shapes.
- The taped forward is then traced with one zero tensor (a tap) per such output as an input:
  `Taps` reads the stage's weights as constants and adds each tap to its output, and the
  call's tensor arguments become outputs of the forward.
- B is the tape's gradient of the stage's inputs and of the taps: each tap's gradient is its
  output's. No weight gradient is computed. (One tap per output, not slices of one vector: a
  slice's gradient is as long as the whole vector, measured 2x slower for 6 layers.)
- W (`weight_gradients`) calls each recorded layer again on its saved arguments and
  differentiates its outputs with respect to the layer's own weights, given that output
  gradient. Grappler prunes what the weight gradient does not read (a linear layer's product).

`Taps.refusals` says why a stage cannot be split this way, and the stage then runs a merged
backward: a weight read outside its owner's call (e.g. a tied embedding read by another
layer), a layer called inside a loop or nested function (an RNN's cell), a layer with random
draws, one that adds a loss or runs in another dtype than float32; `engine/stages/tap_shapes.py`
gives each tap its shape.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import keras
import tensorflow as tf
from keras import tree

from hyparflow import _keras
from hyparflow.engine.stages.runner import UpdateRecordingScope
from hyparflow.intercept import replaced_calls


@dataclass
class LayerCall:
    """One call of a layer that owns weights, as the forward's trace made it: `args` and
    `kwargs` with each tensor replaced by its position in the saved tensors, and the shapes of
    its float outputs (first dimension the batch's, else fixed)."""

    layer: object
    replay: object  # the layer's call as the forward ran it (its instance's own, if set)
    args: tuple
    kwargs: dict
    saved: int  # how many tensors of the saved list are this call's
    output_shapes: list = field(default_factory=list)
    hoisted: bool = False  # tapped before its activation, which W then leaves out


class _Slot:
    """Where a saved tensor goes back into a call's arguments."""

    def __init__(self, index: int):
        self.index = index


def _stock_call_classes() -> tuple:
    """Keras layers whose own `call` applies `self.activation` last, to its whole output."""
    return (
        keras.layers.Dense,
        keras.layers.EinsumDense,
        keras.layers.Conv1D,
        keras.layers.Conv2D,
        keras.layers.Conv3D,
    )


def hoistable_activation(layer):
    """`layer`'s activation where its call applies it last (a stock Dense, EinsumDense or
    convolution) and it is not linear, else None. The tap then goes before it and W replays
    the call without it: a ReLU's or GELU's gradient needs the call's output, which W would
    otherwise compute again."""
    activation = getattr(layer, "activation", None)
    if activation is None or activation is keras.activations.linear:
        return None
    stock = any(type(layer).call is cls.call for cls in _stock_call_classes())
    return activation if stock and "call" not in vars(layer) else None


@contextlib.contextmanager
def _without_activation(layer):
    """`layer` with its activation set to linear for a moment."""
    activation = layer.activation
    object.__setattr__(layer, "activation", keras.activations.linear)
    try:
        yield
    finally:
        object.__setattr__(layer, "activation", activation)


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
        taps = Taps(owners, tap_tensors)  # None: discovery
        with taps:
            outputs = call(inputs)
        saved = taps.saved  # outputs of the forward

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
        self.tapped = 0  # outputs tapped so far
        self._active: list = []
        self._calls = None

    @property
    def updates(self) -> dict:
        return self._scope.updates

    def __enter__(self):
        self._graph = tf.compat.v1.get_default_graph()
        self._scope = _ReadScope(self.owners, self._active, self.refusals)
        # each layer's call tapped, over whatever call it had (hyparflow.moe's sparse experts)
        self._calls = replaced_calls((layer, self._tapping(layer)) for layer in self.layers)
        self._calls.__enter__()
        self._scope.__enter__()
        return self

    def __exit__(self, *exc):
        self._scope.__exit__(*exc)
        self._calls.__exit__(*exc)
        return False

    def _tapping(self, layer):
        """The `make` of `layer`'s tapped call, around the call it had (`intercept.py`)."""

        def make(original):
            def tapped(*args, **kwargs):
                return self._tapped_call(layer, original, args, kwargs)

            return tapped

        return make

    def _refuse_layer(self, layer) -> bool:
        """Record why `layer`'s calls cannot be replayed for its weight gradient, if they
        cannot; True then."""
        reasons = []
        if tf.compat.v1.get_default_graph() is not self._graph:
            reasons.append(f"layer {layer.name} is called inside a loop or nested function")
        if any(_keras.seed_generators(inner) for inner in _keras.all_layers(layer)):
            reasons.append(f"layer {layer.name} draws random numbers")  # a replay would redraw
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
        activation = hoistable_activation(layer)
        self._active.append(layer)
        try:
            with _without_activation(layer) if activation else contextlib.nullcontext():
                outputs = original(*args, **kwargs)
        finally:
            self._active.pop()
        if len(_keras.own_losses(layer)) != losses_before:
            self.refusals.append(f"layer {layer.name} adds a loss in its call")
        record = self._record(layer, original, args, kwargs)
        record.hoisted = activation is not None
        outputs = tree.map_structure(lambda t: self._tap(t, record), outputs)
        return activation(outputs) if activation else outputs

    def _record(self, layer, original, args, kwargs) -> LayerCall:
        start = len(self.saved)

        def keep(value):
            if not _is_tensor(value):
                return value
            self.saved.append(tf.convert_to_tensor(value))
            return _Slot(len(self.saved) - 1 - start)

        call = LayerCall(
            layer,
            original,
            tree.map_structure(keep, args),
            tree.map_structure(keep, kwargs),
            saved=0,
        )
        call.saved = len(self.saved) - start
        self.calls.append(call)
        return call

    def _tap(self, tensor, call: LayerCall):
        """`tensor` plus its tap (float tensors only; at discovery, `tensor` itself)."""
        if not _is_tensor(tensor) or not tensor.dtype.is_floating:
            return tensor
        if tensor.shape.rank is None:
            self.refusals.append(f"layer {call.layer.name}'s output has no known rank")
            return tensor
        call.output_shapes.append(tuple(tensor.shape))
        if self.taps is None:
            return tensor
        if self.tapped >= len(self.taps):
            raise RuntimeError("hyparflow: the forward made more layer calls than discovered")
        tap = self.taps[self.tapped]
        self.tapped += 1
        # a tap shaped for another dimension than its output's would broadcast, silently
        same = tf.debugging.assert_equal(
            tf.shape(tap),
            tf.shape(tensor),
            message=f"hyparflow: the weight tap of layer {call.layer.name} has another shape "
            "than its output (an output dimension that follows another input dimension than "
            "on the first micro-batch); use schedule='1f1b' for this model",
        )
        with tf.control_dependencies([same]):
            tapped = tensor + tf.cast(tap, tensor.dtype)
        mask = _keras.keras_mask(tensor)
        if mask is not None:
            _keras.set_keras_mask(tapped, mask)
        return tapped


def weight_gradients(calls: list[LayerCall], variables: list, saved, output_grads):
    """Each variable's gradient (None where no call reads it), in `variables`' order: every
    call of `calls` replayed on its `saved` arguments and differentiated with respect to its
    layer's own weights, given its outputs' gradients (`output_grads`, the taps').
    Call inside a trace."""
    positions = {id(v): i for i, v in enumerate(variables)}
    grads: list[list] = [[] for _ in variables]
    start, by_output = 0, iter(output_grads)
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
            with (
                keras.StatelessScope(initialize_variables=False),
                _without_activation(call.layer) if call.hoisted else contextlib.nullcontext(),
            ):
                outputs = call.replay(*args, **kwargs)
        floats = [t for t in tree.flatten(outputs) if _is_tensor(t) and t.dtype.is_floating]
        pieces = [tf.cast(next(by_output), t.dtype) for t in floats]
        found = tape.gradient(
            floats,
            sources,
            output_gradients=pieces,
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )
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
