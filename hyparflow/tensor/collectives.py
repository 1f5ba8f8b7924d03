"""Megatron-LM's conjugate communication ops, as differentiable TensorFlow ops over MPI.

Before a column-parallel layer the input is copied to every shard: identity forward,
allreduce backward (Megatron's f). After a row-parallel layer the partial outputs are summed:
allreduce forward, identity backward (its g). A vocabulary-split output projection gathers its
logits: allgather forward, each rank's slice backward. Each counts its collectives in the
`Traffic` record it is given (its trainer's `traffic.of(TAG)`).
"""

from __future__ import annotations

import tensorflow as tf

from hyparflow.comm.in_graph import allgather, allreduce
from hyparflow.comm.traffic import Traffic

TAG = "tensor"  # their traffic record's tag: the profiler's "tensor" category


def copy_to_shards(comm, x, traffic: Traffic):
    """Identity forward; the input gradient summed over the tensor ranks of `comm`."""

    @tf.custom_gradient
    def copied(x):
        def gradient(upstream):
            return allreduce(comm, upstream, traffic)

        return tf.identity(x), gradient

    return copied(x)


def reduce_from_shards(comm, x, traffic: Traffic):
    """The partial results of the tensor ranks of `comm` summed; the gradient passes as is."""

    @tf.custom_gradient
    def reduced(x):
        def gradient(upstream):
            return tf.identity(upstream)

        return allreduce(comm, x, traffic), gradient

    return reduced(x)


def gather_from_shards(comm, x, traffic: Traffic, axis: int = -1):
    """The tensor ranks' pieces put together along `axis`; the gradient is this rank's slice."""
    shard = comm.Get_rank()

    @tf.custom_gradient
    def gathered(x):
        def gradient(upstream):
            size = tf.shape(x)[axis]
            rank = x.shape.rank
            begin = [0] * rank
            sizes = [-1] * rank
            where = axis % rank
            begin[where] = shard * size
            sizes[where] = size
            return tf.slice(upstream, begin, sizes)

        return allgather(comm, x, axis % x.shape.rank, traffic), gradient

    return gathered(x)
