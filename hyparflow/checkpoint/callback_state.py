"""The state of Keras's own callbacks that a checkpoint holds, so a resumed run's callbacks go on
as the uninterrupted run's would.

`History` keeps the epochs trained before the checkpoint (a resumed run's History then has every
epoch, not only those after it), `EarlyStopping` and `ReduceLROnPlateau` their patience counters
and best value, `ModelCheckpoint` its best value (`save_best_only`). The learning rate that
`ReduceLROnPlateau` lowered is an optimizer variable, saved with the optimizer. A callback is
matched by its class and its place among the callbacks of that class. `EarlyStopping`'s best
weights (`restore_best_weights=True`) are not held: `check_resumable` refuses a resume that
would need them (docs/reliability.md, "Resume").
"""

from __future__ import annotations

from collections import Counter
from numbers import Integral

from keras import callbacks as keras_callbacks

# Keras resets these in on_train_begin; a resumed run sets them back after it
HELD = (
    (keras_callbacks.History, ("epoch", "history")),
    (keras_callbacks.EarlyStopping, ("wait", "stopped_epoch", "best", "best_epoch")),
    (keras_callbacks.ReduceLROnPlateau, ("wait", "cooldown_counter", "best")),
    (keras_callbacks.ModelCheckpoint, ("best",)),
)


def capture(callbacks) -> list[dict]:
    """The held state of each callback of `callbacks` that has one, as JSON-ready values.

    Example:
        >>> stop = keras_callbacks.EarlyStopping(patience=3)
        >>> stop.on_train_begin(); stop.wait, stop.best = 2, 0.25
        >>> capture([stop])
        [{'callback': 'EarlyStopping', 'index': 0, 'state': {'wait': 2, 'stopped_epoch': 0, \
'best': 0.25, 'best_epoch': 0}}]
    """
    held = []
    for callback, (name, index), attributes in _placed(callbacks):
        state = {attribute: _plain(getattr(callback, attribute, None)) for attribute in attributes}
        held.append({"callback": name, "index": index, "state": state})
    return held


def restore(callbacks, held: list[dict]) -> None:
    """Set each callback's held state back (after Keras's on_train_begin reset it); callbacks
    the checkpoint has no state for keep their fresh one."""
    saved = _by_place(held)
    for callback, place, _ in _placed(callbacks):
        for attribute, value in saved.get(place, {}).items():
            setattr(callback, attribute, _copied(value))


def check_resumable(callbacks, held: list[dict], resumed_epoch: int) -> None:
    """Refuse to resume with an `EarlyStopping(restore_best_weights=True)` whose best epoch came
    before the checkpoint: its best weights were kept in memory only, so the resumed run could
    not restore them as the uninterrupted one would."""
    saved = _by_place(held)
    for callback, place, _ in _placed(callbacks):
        state = saved.get(place, {})
        needed = state.get("best") is not None and state.get("best_epoch", 0) < resumed_epoch
        if getattr(callback, "restore_best_weights", False) and needed:
            raise ValueError(
                f"Cannot resume exactly: EarlyStopping(restore_best_weights=True) found its "
                f"best {callback.monitor} in epoch {state['best_epoch'] + 1}, before the "
                f"checkpoint, and kept those weights in memory only (a checkpoint does not hold "
                "them). Resume without restore_best_weights, or keep the best weights with "
                "keras.callbacks.ModelCheckpoint(save_best_only=True)."
            )


def _placed(callbacks):
    """(callback, its place: (class name, its index among callbacks of that class), the
    attributes held) for each callback of a held kind."""
    seen = Counter()
    for callback in callbacks:
        for kind, attributes in HELD:
            if isinstance(callback, kind):
                name = kind.__name__
                yield callback, (name, seen[name]), attributes
                seen[name] += 1
                break


def _by_place(held: list[dict]) -> dict:
    """Each held state by its callback's place, as `_placed` gives it."""
    return {(entry["callback"], entry["index"]): entry["state"] for entry in held}


def _plain(value):
    """A JSON value: numbers as Python numbers (JSON's NaN and Infinity kept), containers
    recursively."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, str)):
        return value
    return int(value) if isinstance(value, Integral) else float(value)  # numpy, TF scalars


def _copied(value):
    if isinstance(value, dict):
        return {key: list(item) for key, item in value.items()}
    return list(value) if isinstance(value, list) else value
