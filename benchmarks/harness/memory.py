"""Variables' bytes; resident memory now and at its peak is `hyparflow.memory.resident`'s."""

from __future__ import annotations


def variable_bytes(variables) -> int:
    """Bytes of the values of `variables` (Keras or TensorFlow)."""
    import numpy as np

    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables))
