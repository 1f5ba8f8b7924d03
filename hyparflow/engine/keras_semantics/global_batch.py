"""Statistics of the whole global batch inside a layer: `hf.global_mean`.

A layer that normalises by, or adds a loss of, a mean over the batch computes another value
when each replica sees only its rows. `global_mean(x)` is the mean over the rows of every
replica: the replicas sum their rows and counts with one allreduce inside the compiled step
(as synchronised BatchNormalization sums its moments), and the gradient of each replica's
loss through the mean reaches every replica's rows (the upstream gradients summed the same
way). The engine says which replicas form the batch while it traces (`batch_group`); outside
it (one process, plain Keras) the mean is the plain one. Micro-batches cannot see each
other's rows before their backward starts, so a call under them is refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import tensorflow as tf
from keras import ops

from hyparflow import _keras
from hyparflow.comm.in_graph import allreduce
from hyparflow.comm.traffic import Traffic

TAG = "global"  # the tag of its traffic record in the trainer's `TrafficLog`


@dataclass
class BatchGroup:
    """The replicas whose rows form the global batch (`comm`, None with one replica), the
    micro-batches each runs, the names of the layers whose calls took a global mean, and the
    record their sums count in (`traffic`: the trainer's, else one of the group's own)."""

    comm: object
    microbatches: int
    users: set = field(default_factory=set)
    traffic: Traffic = field(default_factory=Traffic)


_ACTIVE: list[BatchGroup] = []


@contextlib.contextmanager
def batch_group(group: BatchGroup):
    """While entered, `global_mean` takes its means over the rows of `group`'s replicas and
    refuses micro-batches; it notes in `group.users` the layers that called it."""
    _ACTIVE.append(group)
    try:
        yield
    finally:
        _ACTIVE.pop()


def global_mean(x, axis: int = 0):
    """The mean of `x` over the global batch along `axis` (the batch axis), differentiable:
    under `hf.fit` the rows of every replica, in one process `keras.ops.mean(x, axis)`.

    For example, a layer that centres its inputs on the batch's mean:

        def call(self, x):
            return x - hf.global_mean(x)
    """
    group = _ACTIVE[-1] if _ACTIVE else None
    if group is None:
        return ops.mean(x, axis=axis)
    layer = _keras.calling_layer()
    if layer is not None:  # its added losses are exact: no "batch means" warning for them
        group.users.add(layer.name)
    if group.microbatches > 1:
        raise ValueError(
            "hf.global_mean needs the whole global batch in one forward pass, and this step "
            f"runs it in {group.microbatches} micro-batches, whose rows meet only after the "
            "first backward has started; use num_microbatches=1 (replicas are exact)."
        )
    x = tf.convert_to_tensor(x)
    moved = tf.experimental.numpy.moveaxis(x, axis, 0)
    if group.comm is None:
        return tf.reduce_mean(moved, axis=0)
    return _replicas_mean(group.comm, group.traffic, moved)


def _replicas_mean(comm, traffic: Traffic, rows):
    """The mean of `rows` (batch first) over every replica's rows in `comm`, its sums counted
    in `traffic`."""
    shape = tf.shape(rows)[1:]

    @tf.custom_gradient
    def mean(rows):
        count = tf.cast(tf.shape(rows)[0], rows.dtype)
        local = tf.concat([tf.reshape(tf.reduce_sum(rows, axis=0), [-1]), [count]], axis=0)
        total = allreduce(comm, local, traffic)
        rows_everywhere = total[-1]
        value = tf.reshape(total[:-1], shape) / rows_everywhere

        def gradient(upstream):  # every replica's loss reaches these rows through the mean
            summed = allreduce(comm, tf.reshape(upstream, [-1]), traffic)
            each = tf.reshape(summed, shape) / rows_everywhere
            return tf.broadcast_to(each[None], tf.shape(rows))

        return value, gradient

    return mean(rows)
