"""BatchNormalization statistics of the whole global batch, summed across replicas in the step.

Keras's `BatchNormalization(synchronized=True)` sums its statistics across the replicas of a
`tf.distribute` strategy; in one process it normalises by the whole batch. Across hyparflow's
replicas, each sees a shard, so the sums must cross MPI inside the compiled forward (and the
sums of their gradients inside the backward), as Horovod's and PyTorch's SyncBatchNorm do
(Ioffe & Szegedy 2015; Peng et al., "MegDet", CVPR 2018). `synchronized_batchnorm` makes the
stage's BatchNormalization layers compute their moments that way while it is active: those
with `synchronized=True` always, the others too when the strategy asks for it
(`Strategy(sync_batchnorm=True)`), each with the formula Keras uses for its own flag.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

from hyparflow import _keras
from hyparflow.comm.in_graph import allreduce
from hyparflow.comm.traffic import Traffic
from hyparflow.intercept import Replaced, instead

TAG = "batchnorm"  # the tag of its traffic record in the trainer's `TrafficLog`


def cross_replica_sum(comm, tensor, traffic: Traffic):
    """`tensor` summed over the ranks of `comm` (in graph or eagerly), counted in `traffic`;
    its gradient is the sum of the gradients, since every rank's loss reads the total."""

    @tf.custom_gradient
    def summed(x):
        def gradient(upstream):
            return allreduce(comm, upstream, traffic)

        return allreduce(comm, x, traffic), gradient

    return summed(tensor)


def _global_moments(comm, traffic: Traffic, synchronized_formula: bool):
    """A `BatchNormalization._moments` replacement over the replicas of `comm` (its sums
    counted in `traffic`)."""

    def replica_sum(tensor):
        return cross_replica_sum(comm, tensor, traffic)

    def moments(layer, inputs, mask):
        if mask is not None:
            raise ValueError(
                f"BatchNormalization layer {layer.name!r} gets a mask; hyparflow synchronises "
                "only unmasked batch statistics. Use synchronized=False for it."
            )
        axes = _keras.reduction_axes(layer)
        x = tf.cast(inputs, tf.float32) if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        total = replica_sum(tf.reduce_sum(x, axis=axes, keepdims=True))
        count = replica_sum(count)
        mean = tf.math.divide_no_nan(total, count)
        if synchronized_formula:  # Keras's synchronized moments: E(x^2) - E(x)^2
            squares = replica_sum(tf.reduce_sum(tf.square(x), axis=axes, keepdims=True))
            variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
        else:  # tf.nn.moments: the mean of squared deviations from the (global) mean
            deviations = tf.reduce_sum(
                tf.math.squared_difference(x, tf.stop_gradient(mean)), axis=axes, keepdims=True
            )
            variance = tf.math.divide_no_nan(replica_sum(deviations), count)
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
        if x.dtype != inputs.dtype:  # as Keras: statistics in float32, handed back as input's
            mean = tf.cast(tf.clip_by_value(mean, tf.float16.min, tf.float16.max), inputs.dtype)
            variance = tf.cast(
                tf.clip_by_value(variance, tf.float16.min, tf.float16.max), inputs.dtype
            )
        return mean, variance

    return moments


def synchronized_layers(layers, force: bool) -> list:
    """The BatchNormalization layers among `layers` whose statistics span the global batch."""
    return [
        layer
        for layer in layers
        if isinstance(layer, keras.layers.BatchNormalization) and (layer.synchronized or force)
    ]


def synchronized_batchnorm(comm, traffic: Traffic, layers) -> Replaced:
    """While active (around tracing the stage's training forward), `layers` (BatchNormalization)
    compute their batch moments over every replica of `comm`, their sums counted in `traffic`
    (each layer alone, its moments put back on exit)."""
    return Replaced(
        (layer, _keras.BATCHNORM_MOMENTS, instead(_moments_over(comm, traffic, layer)))
        for layer in layers
    )


def _moments_over(comm, traffic: Traffic, layer):
    """`layer`'s `_moments(inputs, mask)` over every replica of `comm`."""
    return functools.partial(_global_moments(comm, traffic, layer.synchronized), layer)
