"""The whole optimizer state in a saved Keras file, as one process training alone writes it.

After a split run each rank's optimizer holds the slots of its own stage's variables, of its
tensor pieces or of its ZeRO slices, so Keras's `model.save` writes a partial state that
`load_model` skips with a warning ("Skipping variable loading for optimizer"). The whole state,
keyed as checkpoints key it (`opt/<i>/<slot>`, `opt/<name>`: checkpoint/state.py), becomes an
optimizer built as Keras builds one for `model.trainable_variables`; saved files take their
optimizer variables from it, in Keras's order, so a plain `load_model` and `fit` continue as if
the run had never been split (docs/reliability.md, "Saved files hold the whole optimizer
state").
"""

from __future__ import annotations

import contextlib
import warnings

import keras

from hyparflow import _keras, deferred
from hyparflow.checkpoint.state import _slot_prefixes, restore_optimizer

_OWN_SAVE = "save_own_variables"


def whole_optimizer(model, state, optimizer=None, variables=None):
    """A fresh optimizer configured as `optimizer` (default `model.optimizer`), built for
    `variables` (default the model's trainable variables: a model's own step may apply an
    optimizer to part of them) and holding the whole entries of `state` (every slot, the step
    counter)."""
    optimizer = model.optimizer if optimizer is None else optimizer
    whole = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    variables = model.trainable_variables if variables is None else variables
    restore_optimizer(model, whole, list(variables), state)
    return whole


def save_whole_state(optimizer, model, read_state, variables=None) -> None:
    """Make `optimizer` write the whole optimizer state that `read_state()` gives (whole
    entries) into every file Keras saves (`model.save`, `save_weights`, ModelCheckpoint) until
    it takes another step (then its own variables, as Keras would). The state is read and the
    optimizer those files need built at the first save, not before: a run that saves nothing
    never pays for them. The method is swapped on this one object; its own variables keep
    training. `variables`: those a whole `optimizer` is built for (default the model's
    trainable variables)."""
    built: list = []

    def whole():
        if not built:
            built.append(whole_optimizer(model, read_state(), optimizer, variables))
        return built[0]

    _write_from(optimizer, whole)


def _write_from(optimizer, whole) -> None:
    step = int(optimizer.iterations.numpy())
    own = type(optimizer).save_own_variables

    def save_own_variables(store):
        if int(optimizer.iterations.numpy()) != step:  # trained since, by a plain model.fit
            own(optimizer, store)
            return
        try:
            source = whole()
        except Exception as error:  # noqa: BLE001 - a file with rank 0's state, as before
            warnings.warn(
                f"hyparflow could not put the whole optimizer state together ({error}); the "
                "file holds this rank's optimizer variables only.",
                stacklevel=2,
            )
            source = None
        if source is None:
            own(optimizer, store)
        else:
            source.save_own_variables(store)

    # object.__setattr__: Keras tracks what is set on an optimizer; a method is not state
    object.__setattr__(optimizer, _OWN_SAVE, save_own_variables)
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer's, saved apart
    if inner is not None:
        _write_from(inner, lambda: whole().inner_optimizer)


def drop_whole_state(optimizer) -> None:
    """Forget a whole state given by `save_whole_state` (training is about to change it)."""
    if optimizer is not None and _OWN_SAVE in vars(optimizer):
        object.__delattr__(optimizer, _OWN_SAVE)
        drop_whole_state(getattr(optimizer, "inner_optimizer", None))


def optimizer_keys(model, optimizer) -> dict:
    """id(variable) -> checkpoint key of each of `optimizer`'s variables (built for `model`)."""
    prefixes = _slot_prefixes(model)
    keys = {}
    for variable in optimizer.variables:
        name = variable.name
        keys[id(variable)] = next(
            (f"opt/{i}/{name[len(p) :]}" for p, i in prefixes if name.startswith(p)),
            f"opt/{name}",
        )
    return keys


def stream_optimizer(model, state) -> dict:
    """Build `model.optimizer` for `hf.export` without allocating its slots (`hf.scope()`),
    its step counter and other whole variables set from `state`; return id(slot) -> key for
    the export's reader. A checkpoint without optimizer entries leaves it unbuilt ({})."""
    optimizer = model.optimizer
    if not any(key.startswith("opt/") for key in state):
        return {}
    if not optimizer.built:
        variables = list(model.trainable_variables)
        with deferred.scope(), _keyed_by_identity(optimizer, variables):
            optimizer.build(variables)
    keys = optimizer_keys(model, optimizer)
    missing = [key for key in keys.values() if key not in state]
    if missing:
        raise ValueError(
            f"The checkpoint has no optimizer state for {missing[:3]}; it was written with a "
            "different optimizer. Compile the model with the optimizer it was trained with."
        )
    slots = {}
    for variable in optimizer.variables:
        if deferred.is_deferred(variable):  # read from the checkpoint as the file is written
            slots[id(variable)] = keys[id(variable)]
        else:  # made with the optimizer (step counter, learning rate), or built before
            variable.assign(state[keys[id(variable)]])
    return slots


@contextlib.contextmanager
def _keyed_by_identity(optimizer, variables):
    """While `optimizer` is built for deferred weights: TensorFlow's optimizers read each
    weight (to place its slots beside it, a no-op on one device) and key it by its
    tf.Variable, which a deferred weight has not got. Reads give a scalar zero and keys are
    identities; the export only writes this optimizer, it never applies it."""
    if not any(deferred.is_deferred(v) for v in variables):
        yield
        return
    _keras.key_variables_by_identity(optimizer)
    try:
        with deferred.reading(lambda variable: 0):
            yield
    finally:
        _keras.restore_variable_keys(optimizer)
