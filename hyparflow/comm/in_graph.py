"""MPI collectives as TensorFlow ops, run in one order on every rank of a compiled step.

A compiled step calls MPI from inside its graph (synchronised BatchNormalization's sums,
tensor-parallel layers' allreduces) through `tf.numpy_function`. TensorFlow may run
independent ops in any order, but every rank must enter a communicator's collectives in the
same one, so each new collective takes the output of the last one created in its graph as an
input it ignores (creation order is the same on every rank: the graph is traced from the same
code). A data edge, not a control dependency: Grappler's dependency optimizer dropped such
control edges between two collectives, and two ranks then ran them in different orders. The
graph itself holds that last collective, in an attribute: it lives and goes with the graph.
Each collective counts its calls, bytes and seconds in the `Traffic` record its caller passes
(`comm/traffic.py`: the caller's trainer owns the records).
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from hyparflow.comm.traffic import Traffic

_LAST_COLLECTIVE = "_hyparflow_last_collective"

# MPI reduces these natively; other floats (float16, bfloat16) travel as float32.
_MPI_FLOATS = (np.float32, np.float64)


def allreduce(comm, tensor, record: Traffic):
    """`tensor` summed over the ranks of `comm` (no gradient: wrap it in a custom one); counted
    in `record`."""

    def reduce(array):
        total = _wire(array)
        start = time.perf_counter()
        comm.Allreduce(_mpi("IN_PLACE"), total)
        record.record(start, time.perf_counter(), total.nbytes)
        return total.astype(array.dtype, copy=False)

    return _ordered(reduce, [tensor], tensor.dtype, tensor.shape)


def allgather(comm, tensor, axis: int, record: Traffic):
    """The `comm` ranks' `tensor`s put together along `axis`, in rank order; counted in
    `record`."""
    size = comm.Get_size()

    def gather(array):
        parts = np.empty((size,) + array.shape, _wire(array[:0]).dtype)
        mine = np.ascontiguousarray(_wire(array))
        start = time.perf_counter()
        comm.Allgather(mine, parts)
        record.record(start, time.perf_counter(), mine.nbytes)
        # along axis 0 the received blocks are already in place: no second whole copy
        joined = parts.reshape((-1, *array.shape[1:])) if axis == 0 else np.concatenate(parts, axis)
        return joined.astype(array.dtype, copy=False)

    shape = tensor.shape.as_list() if tensor.shape.rank is not None else None
    if shape is not None and shape[axis] is not None:
        shape[axis] *= size
    return _ordered(gather, [tensor], tensor.dtype, shape)


def collective(function, tensors: list, dtype, shape, record: Traffic, nbytes: int):
    """`function(*arrays)` (numpy in, one array out, of `dtype` and `shape`), a collective of
    the caller's own run in this graph's order of collectives (e.g. a windowed
    reduce-scatter); counted in `record` as `nbytes` sent."""

    def timed(*arrays):
        start = time.perf_counter()
        result = function(*arrays)
        record.record(start, time.perf_counter(), nbytes)
        return result

    return _ordered(timed, tensors, dtype, shape)


def in_order(function, tensors: list, dtype, shape):
    """`function(*arrays)` (numpy in, one array out) run in this graph's order of collectives
    without being one: a call that starts a collective on another thread (whose collectives
    must begin in one order on every rank too); uncounted (the thread counts its own)."""
    return _ordered(function, tensors, dtype, shape)


def exchange(comm, counts, tensors: list, record: Traffic, expected=None, timed=None) -> tuple:
    """Rows sent to each rank of `comm` and rows received from each, all-to-all: the leading
    `counts[j]` rows of every tensor in `tensors` (after those for ranks before `j`) go to rank
    `j`. Returns (the counts received from each rank, the received rows of each tensor, in
    rank order); no gradient (wrap it in a custom one). `expected`, when the counts to receive
    are known (a reply), saves their all-to-all. Its bytes count in `record`;
    `timed(start, end, nbytes)`, if given, hears of it too."""
    size = comm.Get_size()

    def swap(sent_counts, received_counts, *arrays):
        sent_counts = np.asarray(sent_counts, np.int64)
        start = time.perf_counter()
        if received_counts.size == 0:
            received_counts = np.empty(size, np.int64)
            comm.Alltoall(sent_counts, received_counts)
        received_counts = np.asarray(received_counts, np.int64)
        received, nbytes = [], 0
        for array in arrays:
            send = np.ascontiguousarray(_wire(array) if array.dtype.kind == "f" else array)
            width = int(np.prod(array.shape[1:], dtype=np.int64))
            rows = np.empty((int(received_counts.sum()),) + array.shape[1:], send.dtype)
            comm.Alltoallv(
                [send, (sent_counts * width, None)], [rows, (received_counts * width, None)]
            )
            received.append(rows.astype(array.dtype, copy=False))
            nbytes += send.nbytes
        end = time.perf_counter()
        record.record(start, end, nbytes)
        if timed is not None:
            timed(start, end, nbytes)
        return [received_counts.astype(np.int32)] + received

    known = tf.zeros([0], tf.int32) if expected is None else expected

    dtypes = [tf.int32] + [t.dtype for t in tensors]
    outputs = _ordered(swap, [counts, known, *tensors], dtypes, None)
    outputs[0].set_shape([size])
    for tensor, received in zip(tensors, outputs[1:], strict=True):
        received.set_shape([None] + tensor.shape.as_list()[1:])
    return outputs[0], outputs[1:]


def _ordered(function, inputs: list, dtypes, shape):
    """`tf.numpy_function(function, inputs, dtypes)`, run after the last collective created in
    the graph (its output an extra input `function` does not see), then the last one itself.
    Several outputs (`exchange`): the first stands for the op."""
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    previous = getattr(graph, _LAST_COLLECTIVE, None)
    after = [] if previous is None else [_token(previous)]
    count = len(inputs)
    result = tf.numpy_function(
        lambda *arrays: function(*arrays[:count]), [*inputs, *after], dtypes, stateful=True
    )
    if shape is not None:
        result.set_shape(shape)
    if graph is not None:
        setattr(graph, _LAST_COLLECTIVE, result[0] if isinstance(result, list) else result)
    return result


def _token(previous):
    """What of `previous` the next collective takes: its first element, so that it is not
    copied whole to the host for a function that ignores it (where its size is unknown or
    0, all of it: an empty slice of a known shape could be folded into a constant)."""
    flat = tf.reshape(previous, [-1])
    known = flat.shape[0]
    return flat[:1] if known else flat


def _wire(array):
    """A contiguous copy MPI can reduce in place."""
    dtype = array.dtype if array.dtype.type in _MPI_FLOATS else np.float32
    return np.array(array, dtype=dtype, copy=True)


def _mpi(name: str):
    """`MPI.<name>` ("SUM", "IN_PLACE")."""
    # mpi4py's import starts MPI: deferred so that importing hyparflow never starts it.
    from mpi4py import MPI

    return getattr(MPI, name)
