"""This rank's shards of the split variables, and the context that puts them in the layers.

The user's model keeps its whole variables. For each split variable a rank holds one shard
variable (its slice, with the variable's path, so optimizer slots and checkpoints name it as
Keras does); while `active()` the layers hold the shards instead and split layers run their
tensor-parallel call. Everything the engine compiles is traced inside the context, so steps
train the shards, and outside it the model is the user's whole one: `store()` gathers the
shards into it and `load()` slices it into the shards. While hf.fit trains, the whole
variables hold nothing (`release`, `deferred.let_go`): the shards are the weights until
`store()` gives the wholes their values again, so a rank never holds both.
"""

from __future__ import annotations

import contextlib
import inspect

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from hyparflow import _keras, deferred
from hyparflow.checkpoint.state import cut_shard
from hyparflow.intercept import instead, replaced_calls
from hyparflow.tensor.collectives import copy_to_shards, gather_from_shards, reduce_from_shards
from hyparflow.tensor.layout import bounds
from hyparflow.tensor.splits import COLUMN, ROW, VOCAB

_WHILE_TRAINING = (
    "hf.fit holds this weight as shards spread over the tensor (or expert) ranks while it "
    "trains; the epoch's end gives it back. Read weights at epoch ends or after hf.fit."
)


class Shard:
    """One split variable: where the layer holds it, its whole form and this rank's shard."""

    def __init__(self, layer, whole, axis: int, parts: int, index: int):
        self.layer, self.whole, self.axis = layer, whole, axis
        self.parts, self.index = parts, index
        self.attribute = _attribute_holding(layer, whole)
        self.shard = _new_variable_like(whole, self.shard_of_whole())

    def shard_of_whole(self):
        """This rank's piece of the whole variable's current value (its initial value when
        it was built under hf.scope(): the whole is then never allocated)."""
        whole = self.whole
        value = deferred.initial_value(whole) if deferred.is_deferred(whole) else whole.numpy()
        return cut_shard(np.asarray(value), self.index, self.parts, self.axis)

    def load(self) -> None:
        """Cut the whole variable's value into the shard (a whole that was never allocated,
        under hf.scope(), or that is let go while the fit trains, leaves the shard as it is:
        the shard is the truth)."""
        if not (deferred.is_deferred(self.whole) or deferred.is_let_go(self.whole)):
            self.shard.assign(self.shard_of_whole())

    def take_over(self) -> None:
        """Give the whole variable a backing that `release` can empty and `store` fill again
        (`deferred.take_over`): steps traced over it stay valid. Keras's compiled steps traced
        over the old one must be dropped by the caller."""
        if not deferred.is_deferred(self.whole):
            deferred.take_over([self.whole], _WHILE_TRAINING)

    def release(self) -> None:
        """Take the whole variable's value into the shard (a callback may have set it), then
        let the whole go, its memory with it, until `store` (nothing where it holds none)."""
        if deferred.is_deferred(self.whole) or deferred.is_let_go(self.whole):
            return
        self.load()
        deferred.let_go([self.whole])

    def store(self, comm, guard, operation: str) -> None:
        """Put the shards of the `parts` ranks of `comm` together into the whole variable
        (collective over `comm`; `guard(operation)` watches the wait). Under hf.scope() no
        rank holds the whole: nothing is gathered."""
        if deferred.is_deferred(self.whole):
            return
        if deferred.is_let_go(self.whole):  # the pieces below fill all of it
            deferred.hold(self.whole, tf.zeros(self.whole.shape, self.whole.dtype))
        local = np.ascontiguousarray(np.asarray(self.shard.numpy()))
        piece = np.empty_like(local)
        target = _keras.stored_value(self.whole)
        # one piece at a time, each broadcast by its owner and written into its place: the
        # pieces are never held together, nor a concatenated copy (4x a piece's bytes before)
        for owner in range(self.parts):
            if owner == self.index:
                piece[...] = local
            with guard(operation):
                comm.Bcast(piece.reshape(-1).view(np.uint8), root=owner)
            target[self._place(owner)].assign(piece)

    def _place(self, owner: int) -> tuple:
        """The index of shard `owner`'s piece in the whole variable."""
        step = self.whole.shape[self.axis] // self.parts
        where = [slice(None)] * len(self.whole.shape)
        where[self.axis] = slice(owner * step, (owner + 1) * step)
        return tuple(where)


class TensorShards:
    """The shards of `layout` (a `TensorLayout`) held by shard `comm.Get_rank()` of the tensor
    ranks in `comm`, whose collectives count in `traffic` (a `Traffic` record).
    `dropout_scope(axis, index, parts)` is the context under which a Dropout draws the whole
    tensor's mask and keeps its slice (the engine's `random_slices`)."""

    def __init__(self, layout, comm, traffic, dropout_scope):
        self.layout, self.comm, self.traffic = layout, comm, traffic
        self.parts, self.index = comm.Get_size(), comm.Get_rank()
        self._dropout_scope = dropout_scope
        self.shards = [
            Shard(split.layer, v, axis, self.parts, self.index)
            for split in layout.splits
            for v, axis in split.axes.values()
        ]
        self._calls = {id(s.layer): (s.layer, self._call_for(s)) for s in layout.splits}
        for layer, axis in layout.dropouts:
            self._calls[id(layer)] = (layer, self._dropout_call(layer, axis))
        for layer, names in layout.copies:
            self._calls[id(layer)] = (layer, self._copying_call(layer, names))
        for layer in layout.summed:
            self._calls[id(layer)] = (layer, self._summing_call(layer))
        self._rows = [split.layer for split in layout.splits if split.role == ROW]
        self._depth = 0

    @property
    def variables(self) -> list:
        """This rank's shard variables."""
        return [s.shard for s in self.shards]

    def load(self) -> None:
        """Slice the model's whole variables into this rank's shards (a whole that was never
        allocated, under hf.scope(), leaves its shard as it is: the shard is the truth)."""
        for s in self.shards:
            s.load()

    def by_path(self) -> dict:
        """Path -> this rank's shard variable, for each split variable."""
        return {s.whole.path: s.shard for s in self.shards}

    def store(self, guard) -> None:
        """Put the shards of every tensor rank together into the model's whole variables
        (collective over the tensor ranks; `guard(operation)` watches the wait)."""
        for s in self.shards:
            s.store(self.comm, guard, "gather tensor shards")

    @contextlib.contextmanager
    def active(self):
        """Layers hold this rank's shards and run their tensor-parallel calls (re-entrant)."""
        self._depth += 1
        if self._depth > 1:
            try:
                yield
            finally:
                self._depth -= 1
            return
        swapped, specs = [], []
        calls = replaced_calls((layer, instead(call)) for layer, call in self._calls.values())
        try:
            for s in self.shards:
                swap_variable(s.layer, s.attribute, s.whole, s.shard)
                swapped.append(s)
            calls.__enter__()
            specs = [layer.input_spec for layer in self._rows]
            for layer in self._rows:  # their input is split: Keras's shape check would refuse
                layer.input_spec = None
            yield
        finally:
            self._depth -= 1
            for layer, spec in zip(self._rows, specs, strict=True):
                layer.input_spec = spec
            calls.__exit__(None, None, None)
            for s in reversed(swapped):
                swap_variable(s.layer, s.attribute, s.shard, s.whole)

    # --- the calls of split layers --------------------------------------------------------
    def _call_for(self, split):
        layer, comm, traffic = split.layer, self.comm, self.traffic
        original = type(layer).call.__get__(layer)
        if split.role == COLUMN:
            # A convolution reshapes its bias to its `filters`: this rank's share of them.
            narrowed = {"filters": layer.filters // self.parts} if hasattr(layer, "filters") else {}

            copy = _unchanged if split.input_copied else copy_to_shards

            def column_call(inputs, *args, **kwargs):
                with _attributes(layer, narrowed):
                    return original(copy(comm, inputs, traffic), *args, **kwargs)

            return column_call
        if split.role == ROW:
            return self._row_call(layer, original)
        assert split.role == VOCAB
        return self._vocab_call(layer, original)

    def _row_call(self, layer, original):
        comm, traffic = self.comm, self.traffic

        unbiased = {"bias": None, "activation": None}
        if hasattr(layer, "use_bias"):  # convolutions test the flag, not the variable
            unbiased["use_bias"] = False

        def row_call(inputs, *args, **kwargs):
            bias, activation = layer.bias, layer.activation
            # The partial products are summed first; bias and activation come after, once.
            with _attributes(layer, unbiased):
                outputs = original(inputs, *args, **kwargs)
            outputs = reduce_from_shards(comm, outputs, traffic)
            if bias is not None:
                outputs = ops.add(outputs, bias)
            if activation is not None:
                outputs = activation(outputs)
            return outputs

        return row_call

    def _vocab_call(self, layer, original):
        comm, traffic = self.comm, self.traffic
        begin = bounds(layer.input_dim, self.parts, self.index)[0]
        rows = layer.input_dim // self.parts

        def vocab_call(inputs, reverse=False, **kwargs):
            if reverse:  # a tied (or untied) output projection: logits of this rank's rows
                logits = original(copy_to_shards(comm, inputs, traffic), reverse=True, **kwargs)
                return gather_from_shards(comm, logits, traffic, axis=-1)
            ids = inputs if inputs.dtype in ("int32", "int64") else ops.cast(inputs, "int32")
            local = ids - ops.cast(begin, ids.dtype)
            inside = ops.logical_and(local >= 0, local < rows)
            found = ops.take(layer.embeddings, ops.where(inside, local, 0), axis=0)
            found = ops.where(ops.expand_dims(inside, -1), found, ops.zeros_like(found))
            outputs = reduce_from_shards(comm, ops.cast(found, layer.compute_dtype), traffic)
            if isinstance(layer, keras.layers.ReversibleEmbedding) and layer.mask_zero:
                _keras.set_keras_mask(outputs, ops.not_equal(inputs, 0))
            return outputs

        return vocab_call

    def _copying_call(self, layer, names):
        """`layer`'s call with each distinct tensor among arguments `names` copied to the
        shards once, its Keras mask kept (the projections inside then copy nothing)."""
        original = type(layer).call.__get__(layer)
        signature = inspect.signature(original)
        comm, traffic = self.comm, self.traffic

        def copying_call(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs)
            copies: dict = {}
            for name in names:
                value = bound.arguments.get(name)
                if value is None:
                    continue
                if id(value) not in copies:
                    copies[id(value)] = copy_to_shards(comm, value, traffic)
                    mask = _keras.keras_mask(value)
                    if mask is not None:
                        _keras.set_keras_mask(copies[id(value)], mask)
                bound.arguments[name] = copies[id(value)]
            return original(*bound.args, **bound.kwargs)

        return copying_call

    def _summing_call(self, layer):
        """`layer`'s call reading each of its own weights through `copy_to_shards`: the layer
        acts on this rank's heads only, so the gradients of the tensor ranks are summed into
        the whole weight's (Megatron's f, applied to a weight rather than an input)."""
        original = type(layer).call.__get__(layer)
        weights = _keras.own_trainable_variables(layer)
        names = [_attribute_holding(layer, v) for v in weights]
        comm, traffic = self.comm, self.traffic

        def summing_call(*args, **kwargs):
            read = {
                name: copy_to_shards(comm, _read(layer, v), traffic)
                for name, v in zip(names, weights, strict=True)
            }
            with _attributes(layer, read):
                return original(*args, **kwargs)

        return summing_call

    def _dropout_call(self, layer, axis: int):
        original = type(layer).call.__get__(layer)
        scope, index, parts = self._dropout_scope, self.index, self.parts

        def dropout_call(inputs, *args, **kwargs):
            with scope(axis, index, parts):
                return original(inputs, *args, **kwargs)

        return dropout_call


@contextlib.contextmanager
def _attributes(layer, values: dict):
    """`layer`'s attributes set to `values` for the length of a call (untracked by Keras)."""
    saved = {name: getattr(layer, name) for name in values}
    for name, value in values.items():
        object.__setattr__(layer, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            object.__setattr__(layer, name, value)


def _read(layer, variable):
    """`variable`'s value as `layer`'s call would read it: cast to the layer's compute dtype
    where Keras autocasts it."""
    value = ops.convert_to_tensor(variable)
    autocast = layer.autocast and _keras.variable_autocast(variable)
    if autocast and keras.backend.is_float_dtype(variable.dtype):
        return ops.cast(value, layer.compute_dtype)
    return value


def _unchanged(comm, tensor, traffic):
    return tensor


def _attribute_holding(layer, variable) -> str:
    for name, value in vars(layer).items():
        if value is variable:
            return name
    raise ValueError(f"cannot find where layer {layer.name!r} holds {variable.path}")


def swap_variable(layer, attribute: str, old, new) -> None:
    """Make `layer` hold `new` where it held `old`: its attribute and its tracked list."""
    object.__setattr__(layer, attribute, new)
    tracked = _keras.own_trainable_variables(layer)
    for i, v in enumerate(tracked):
        if v is old:
            tracked[i] = new


def _new_variable_like(whole, value):
    """A variable holding `value`, named and placed (path) like `whole`."""
    scopes = whole.path.split("/")[:-1]
    with contextlib.ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(keras.name_scope(scope))
        shard = keras.Variable(
            value,
            dtype=whole.dtype,
            trainable=whole.trainable,
            name=whole.name,
            autocast=_keras.variable_autocast(whole),
        )
    shard.regularizer = getattr(whole, "regularizer", None)
    shard.constraint = getattr(whole, "constraint", None)
    return shard
