"""Variables built without memory (`hf.scope`), and materialising the ones a rank needs.

Keras defers a variable made inside `keras.StatelessScope(initialize_variables=False)`: it
keeps the initializer and holds no value. Two things make that safe for a model of any size.
The variables are taken off Keras's global list of uninitialised ones, which the next top-level
StatelessScope (Keras opens one for every symbolic call) would otherwise initialise all at
once. And each one's initializer is wrapped (`_NotHeld`): while Keras traces a graph it gives
a placeholder of zeros (no memory, no random draw), and an eager read raises `NotHeldError`,
so a weight a rank does not hold is never read as a fresh random value. `materialize` gives a
variable its value from the initializer it was built with, so the values equal those of an
ordinary build with the same seeds (Keras's random initializers draw their seed when made).

Keras refuses a variable made from a value (not an initializer) inside a StatelessScope, and
compiling makes some: an optimizer's step counter and learning rate. While hf.scope() is open,
`keras.Variable.__init__` makes such a variable anyway (`_from_value`): a non-trainable one (a
counter, a rate, a state) is created with its value, which is small and already in memory; a
trainable one is a weight, deferred like those made by initializers, its value its initializer.

ZeRO-3 lets a built variable's value go between steps and gives it back (`take_over`,
`let_go`, `hold`): the Keras variable gets a backing tf.Variable of TensorFlow's own
`ResourceVariable` class (private: `tensorflow.python.ops`) whose shape is left open, so that
one resource can be emptied and filled again under every step traced over it.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import keras
import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

from hyparflow import _keras


class NotHeldError(ValueError):
    """A weight of a model built under `hf.scope()` was read on a rank that does not hold it."""


class _NotHeld:
    """The initializer of a deferred variable: placeholders in graphs, an error when eager."""

    def __init__(self, variable, initializer):
        self.variable, self.initializer = variable, initializer

    def __call__(self, shape, dtype=None):
        if _reader is not None:  # hf.export: the value from the checkpoint, one at a time
            return tf.convert_to_tensor(_reader(self.variable), dtype=dtype)
        if not tf.executing_eagerly():  # a symbolic call or trace needs only shape and dtype
            return tf.zeros(shape, dtype)
        raise NotHeldError(
            f"{self.variable.path} is not held by this process: the model was built under "
            "hf.scope(), and hf.fit gives each rank only the weights of its own pipeline stage "
            "and tensor shard. Save the trained model with an hf.callbacks.Checkpoint and "
            "write it as one file with hf.export(checkpoint_dir, path), or read the weights "
            "on the rank that trains them."
        )


_reader = None  # hf.export's source of values while it writes a deferred model


@contextlib.contextmanager
def scope():
    """Build and compile a model of any size without allocating its weights.

    Variables made inside by initializers (every layer's weights, the optimizer's slots, metric
    states) are deferred: hf.fit gives each rank only the weights of its own pipeline stage and
    tensor shard (`strategy` decides), with the values an ordinary build would have had.
    Variables made from a value (an optimizer's step counter and learning rate) are small and
    are created as usual, so the optimizer may be made inside too. Reading a weight a rank does
    not hold raises `NotHeldError`; `hf.export` writes the trained model from a checkpoint.

    For example:
        with hf.scope():
            model = build_model()
            model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        hf.fit(model, x, y, strategy=hf.Strategy("model", partitions=4))
    """
    waiting = _keras.uninitialized_variables()
    before = {id(v) for v in waiting}
    try:
        with _values_allowed(), keras.StatelessScope(initialize_variables=False) as stateless:
            yield
    finally:
        made = [v for v in waiting if id(v) not in before]
        waiting[:] = [v for v in waiting if id(v) in before]
        for variable in made:
            _defer(variable)
    assigned = _keras.stateless_updates(stateless)
    if assigned:
        names = [v.path for v in made if id(v) in assigned][:3]
        raise ValueError(
            f"Variables were assigned inside hf.scope() ({names or 'values'}), which holds no "
            "values to assign to. Load or set weights after the scope on an ordinary model, or "
            "resume hf.fit from a checkpoint (resume_from=...)."
        )


# --- variables made from a value inside the scope ----------------------------------------
_KERAS_INIT = keras.Variable.__init__  # Keras's own, whichever class defines it
_OWN_INIT = "__init__" in vars(keras.Variable)  # else inherited: restored by deleting ours
_open = threading.local()  # how many hf.scope() this thread is inside (Keras's state is too)
_patch_lock = threading.Lock()
_patched = [0]  # open hf.scope()s of all threads: the patch is in place while any is


class _Value:
    """The initializer of a trainable variable made from a value inside hf.scope()."""

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None):
        return tf.cast(self.value, dtype) if dtype is not None else self.value


def _from_value(variable, initializer, *args, **kwargs):
    """`keras.Variable.__init__` while an hf.scope() is open (see the module's docstring)."""
    if not getattr(_open, "depth", 0) or callable(initializer) or isinstance(initializer, str):
        return _KERAS_INIT(variable, initializer, *args, **kwargs)
    bound = inspect.signature(_KERAS_INIT).bind(variable, initializer, *args, **kwargs)
    given = bound.arguments
    if not given.get("trainable", True):
        with _keras.outside_stateless_scope():
            return _KERAS_INIT(*bound.args, **bound.kwargs)
    value = keras.ops.convert_to_tensor(initializer, dtype=given.get("dtype"))
    dtype = keras.backend.standardize_dtype(given.get("dtype") or value.dtype)
    given.update(initializer=_Value(value), shape=tuple(value.shape), dtype=dtype)
    return _KERAS_INIT(*bound.args, **bound.kwargs)


@contextlib.contextmanager
def _values_allowed():
    """`_from_value` in place of Keras's `__init__` (which takes `initializer` first and
    `trainable` by name) while any hf.scope() is open; Keras's own again once none is."""
    with _patch_lock:
        if _patched[0] == 0:
            keras.Variable.__init__ = _from_value
        _patched[0] += 1
    _open.depth = getattr(_open, "depth", 0) + 1
    try:
        yield
    finally:
        _open.depth -= 1
        with _patch_lock:
            _patched[0] -= 1
            if _patched[0] == 0 and _OWN_INIT:
                keras.Variable.__init__ = _KERAS_INIT
            elif _patched[0] == 0:
                del keras.Variable.__init__


def _defer(variable) -> None:
    if not isinstance(_keras.deferred_initializer(variable), _NotHeld):
        _keras.set_deferred_initializer(
            variable, _NotHeld(variable, _keras.deferred_initializer(variable))
        )


def is_deferred(variable) -> bool:
    """Whether `variable` was built under hf.scope() and holds no value yet."""
    return _keras.is_uninitialized(variable) and isinstance(
        _keras.deferred_initializer(variable), _NotHeld
    )


def any_deferred(model) -> bool:
    """Whether any of `model`'s variables (weights, metrics, optimizer) is deferred."""
    return any(is_deferred(v) for v in _all_variables(model))


def _all_variables(model) -> list:
    found = list(model.variables) + list(getattr(model, "metrics_variables", []))
    for metric in _keras.compiled_metric_objects(model):  # made in compile(), built later
        found += list(metric.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        found += list(optimizer.variables)
    unique = {id(v): v for v in found}  # `variables` holds seed states, `weights` does not
    return list(unique.values())


def initial_value(variable):
    """The value `variable` starts from (its initializer's), computed without giving it one."""
    initializer = _keras.deferred_initializer(variable).initializer
    return initializer(tuple(variable.shape), dtype=variable.dtype)


def materialize(variables) -> int:
    """Give each deferred variable among `variables` its initial value; return how many."""
    count = 0
    for variable in variables:
        if is_deferred(variable):
            wrapped = _keras.deferred_initializer(variable)
            _keras.set_deferred_initializer(variable, wrapped.initializer)
            _keras.initialize_deferred(variable)
            count += 1
    return count


_BUILT_IN_SCOPE = "_hyparflow_built_in_scope"


def materialize_model(model, keep_deferred=()) -> int:
    """Materialise every deferred variable of `model` except those in `keep_deferred`
    (weights another rank holds, variables held as tensor shards); return how many."""
    skip = {id(v) for v in keep_deferred}
    count = materialize(v for v in _all_variables(model) if id(v) not in skip)
    if count:
        object.__setattr__(model, _BUILT_IN_SCOPE, True)  # not a tracked attribute
    return count


def built_in_scope(model) -> bool:
    """Whether `model` was built under hf.scope(): some variable is still deferred, or was
    until hf.fit materialised it (a user who asks for a model bigger than one rank)."""
    return bool(getattr(model, _BUILT_IN_SCOPE, False)) or any_deferred(model)


@contextlib.contextmanager
def reading(values):
    """Eager reads of deferred variables return `values(variable)` (hf.export's checkpoint
    reader) instead of failing, one variable at a time."""
    global _reader
    previous, _reader = _reader, values
    try:
        yield
    finally:
        _reader = previous


# --- variables whose value hf.fit keeps elsewhere for a while (ZeRO-3's slices) -----------
class _Emptiable(ResourceVariable):
    """The tf.Variable behind a Keras variable whose value hf.fit keeps elsewhere at times
    (`take_over`): its shape is left open, so that `assign` can empty it (its memory freed)
    and fill it again while it stays the same resource, which steps traced over it keep
    reading; reads inside a trace have the Keras variable's shape (Keras's layers need it), and
    an eager read of it empty raises `NotHeldError` with the reason."""

    def _read_variable_op(self, no_copy=False):
        if tf.executing_eagerly() and not self.filled():
            raise NotHeldError(f"{self.owner} is not held now: {self.reason}")
        value = super()._read_variable_op(no_copy=no_copy)
        if not tf.executing_eagerly():
            value.set_shape(self.full_shape)
        return value

    def empty(self) -> None:
        """Drop the value (eagerly or inside a trace). The empty value keeps the variable's
        rank: Grappler infers a resource's shape from the values a graph assigns to it, and
        an empty vector would make it drop the reshape of a 2-D read to a vector as
        redundant (a model's own step under ZeRO-3 flattens its variables to load slices)."""
        self.assign(tf.zeros([0, *self.full_shape[1:]], self.dtype))

    def filled(self) -> bool:
        """Whether it holds a value now (eagerly: the resource's own shape, which the
        variable's static one, left open, does not tell)."""
        shape = tf.raw_ops.VariableShape(input=self.handle)
        return int(tf.reduce_prod(shape)) == self.full_shape.num_elements()


def _emptiable(variable, reason: str) -> _Emptiable:
    """A backing for Keras `variable`: holding its value, or empty where it holds none."""
    if is_deferred(variable):
        value = tf.zeros([0, *variable.shape[1:]], variable.dtype)  # as `empty` leaves it
    else:
        value = _keras.backing(variable).read_value()
    backing = _Emptiable(
        initial_value=value,
        shape=tf.TensorShape(None),
        dtype=variable.dtype,
        trainable=variable.trainable,
        name=variable.name,
    )
    backing.full_shape = tf.TensorShape(variable.shape)
    backing.owner, backing.reason = variable.path, reason
    return backing


def take_over(variables, reason: str) -> None:
    """Give each of `variables` a backing that `let_go` can empty and `hold` fill again, once
    (a deferred one starts empty; the others keep their values). Steps traced before over the
    old backings read those: the caller lets them go (e.g. Keras's compiled steps)."""
    for variable in variables:
        if not isinstance(_keras.backing(variable), _Emptiable):
            _keras.set_backing(variable, _emptiable(variable, reason))


def is_let_go(variable) -> bool:
    """Whether `variable` holds no value now because hf.fit keeps it elsewhere (`let_go`)."""
    backing = _keras.backing(variable)
    return isinstance(backing, _Emptiable) and not backing.filled()


def let_go(variables) -> None:
    """Drop the values of `variables` (taken over: `take_over`), their memory with them, until
    `hold` gives them back; an eager read meanwhile raises `NotHeldError`."""
    for variable in variables:
        _keras.backing(variable).empty()


def hold(variable, value) -> None:
    """Give a variable let go (`let_go`) its `value` again, in the same backing."""
    _keras.backing(variable).assign(tf.convert_to_tensor(value, variable.dtype))
