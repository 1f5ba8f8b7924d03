"""Keras's per-variable `clipnorm` for tensor and expert shards: each by its whole variable's norm.

Keras clips each variable's gradient `g` to `g * c / max(|g|, c)` inside `optimizer.apply`. A
rank holding a shard of a variable sees only its part of `|g|`, so the shards' squares are
summed over the ranks holding the variable's other shards (one allreduce of a vector per
group and step) and each shard is scaled by the whole variable's factor before the optimizer.
Keras's own clip of the shard then changes nothing: its norm is at most `c`.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
from keras import ops

from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.engine.gradients.mpi import mpi_op
from hyparflow.traced import traced


class ShardClipping:
    """Clip the shards among `variables` by their whole variables' norms: `split_groups` holds
    (ids of a group's shards, the communicator of the ranks holding the other shards);
    `guard(operation)` watches each allreduce."""

    def __init__(self, variables, split_groups, guard):
        self._groups = [
            ([i for i, v in enumerate(variables) if id(v) in ids], comm)
            for ids, comm in split_groups
        ]
        self._guard = guard
        self._squares_fn = traced(_squares_of_each, reduce_retracing=True)

    def clip(self, grads: list, clipnorm: float, loss_scale: float) -> list:
        """`grads` (of the loss times `loss_scale`) with each shard's scaled as Keras's
        `clipnorm` scales its whole variable's. Collective over each group."""
        grads = list(grads)
        scale = tf.constant(loss_scale, tf.float32)
        for positions, comm in self._groups:
            taken = [grads[i] for i in positions]
            squares = np.array(self._squares_fn(taken, scale), np.float64)
            with self._guard("sum each split variable's gradient norm over its group"):
                comm.Allreduce(mpi_op("IN_PLACE"), squares)
            for i, square in zip(positions, squares, strict=True):
                factor = tf.cast(clipnorm / max(math.sqrt(square), clipnorm), grads[i].dtype)
                grads[i] = row_sparse.like(grads[i], row_sparse.values_of(grads[i]) * factor)
        return grads


def _squares_of_each(grads, scale):
    """Each gradient's squared norm (a row slice's values, as Keras's clip counts them),
    unscaled."""
    return ops.stack([ops.sum(ops.square(row_sparse.values_of(g))) for g in grads]) / ops.square(
        scale
    )
