"""MPI collectives as TensorFlow ops, run in one order on every rank of a compiled step.

A compiled step calls MPI from inside its graph (synchronised BatchNormalization's sums,
tensor-parallel layers' allreduces) through `tf.numpy_function`. TensorFlow may run
independent ops in any order, but every rank must enter a communicator's collectives in the
same one, so each new collective waits for the last one created in its graph (creation order
is the same on every rank: the graph is traced from the same code). The graph itself holds
that last collective, in an attribute: it lives and goes with the graph.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

_LAST_COLLECTIVE = "_hyparflow_last_collective"

# MPI reduces these natively; other floats (float16, bfloat16) travel as float32.
_MPI_FLOATS = (np.float32, np.float64)


def allreduce(comm, tensor):
    """`tensor` summed over the ranks of `comm` (no gradient: wrap it in a custom one)."""

    def reduce(array):
        total = _wire(array)
        comm.Allreduce(_in_place(), total)
        return total.astype(array.dtype, copy=False)

    return _ordered(lambda: tf.numpy_function(reduce, [tensor], tensor.dtype, stateful=True),
                    tensor.shape)  # fmt: skip


def allgather(comm, tensor, axis: int):
    """The `comm` ranks' `tensor`s put together along `axis`, in rank order."""
    size = comm.Get_size()

    def gather(array):
        parts = np.empty((size,) + array.shape, _wire(array[:0]).dtype)
        comm.Allgather(np.ascontiguousarray(_wire(array)), parts)
        return np.concatenate(list(parts), axis=axis).astype(array.dtype, copy=False)

    shape = tensor.shape.as_list() if tensor.shape.rank is not None else None
    if shape is not None and shape[axis] is not None:
        shape[axis] *= size
    return _ordered(lambda: tf.numpy_function(gather, [tensor], tensor.dtype, stateful=True),
                    shape)  # fmt: skip


def _ordered(make, shape):
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    previous = getattr(graph, _LAST_COLLECTIVE, None)
    with tf.control_dependencies([previous] if previous is not None else []):
        result = make()
    if shape is not None:
        result.set_shape(shape)
    if graph is not None:
        setattr(graph, _LAST_COLLECTIVE, result)
    return result


def _wire(array):
    """A contiguous copy MPI can reduce in place."""
    dtype = array.dtype if array.dtype.type in _MPI_FLOATS else np.float32
    return np.array(array, dtype=dtype, copy=True)


def _in_place():
    # mpi4py's import starts MPI: deferred so that importing hyparflow never starts it.
    from mpi4py import MPI

    return MPI.IN_PLACE
