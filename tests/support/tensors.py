"""Comparisons of received tensors for the communication scenarios: values and buffers."""

import numpy as np
import tensorflow as tf


def same(received, expected) -> bool:
    """Every tensor equal in dtype, shape and values."""
    return all(
        r.dtype == e.dtype and r.shape == e.shape and np.array_equal(np.asarray(r), np.asarray(e))
        for r, e in zip(received, expected, strict=True)
    )


def address(x) -> int:
    """Where a tensor's or array's data starts in memory (equal addresses: no copy)."""
    array = x._numpy() if tf.is_tensor(x) else x
    return array.__array_interface__["data"][0]
