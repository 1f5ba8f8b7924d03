"""How many copies of a variable an optimizer keeps (Adam 2, SGD with momentum 1, SGD 0)."""

from __future__ import annotations

import keras

_PROBE_SHAPE = (64, 64)  # 2-D, so factored optimizers (Adafactor) show their small slots


def optimizer_slots(optimizer) -> float:
    """Optimizer state per trainable variable, in copies of that variable.

    Builds a fresh optimizer from `optimizer.get_config()` for one probe variable and counts
    the elements of the state it creates, so any Keras optimizer (and a LossScaleOptimizer
    around one) is counted as it really builds, without touching the user's optimizer.
    None counts 0.

    Example:
        >>> optimizer_slots(keras.optimizers.Adam()), optimizer_slots(keras.optimizers.SGD())
        (2.0, 0.0)
    """
    if optimizer is None:
        return 0.0
    fresh = type(optimizer).from_config(optimizer.get_config())
    probe = keras.Variable(keras.ops.zeros(_PROBE_SHAPE), name="probe")
    fresh.build([probe])
    elements = sum(
        int(_size(v.shape)) for v in fresh.variables if len(v.shape) > 0 and v is not probe
    )
    return elements / _size(_PROBE_SHAPE)


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
