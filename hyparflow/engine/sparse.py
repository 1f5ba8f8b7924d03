"""Row-sparse gradients (`tf.IndexedSlices`) handed to the optimizer as one process would.

An `Embedding` table's gradient is `tf.IndexedSlices`: one (row index, row value) pair per
token, duplicates included, and Keras's optimizers apply it with sparse semantics (Adam squares
each pair's value; clipping norms sum the pairs' squares). Densifying it, as a dense reduction
does, changes the update. So these gradients stay row slices end to end: micro-batches
concatenate their pairs in order, replicas gather them in rank order, and the optimizer sees
the very pairs of the global batch (docs/engine.md, "Sparse gradients").
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from hyparflow import _keras
from hyparflow.comm.allreduce import reduction_dtype
from hyparflow.comm.rows import gather_rows
from hyparflow.engine.mpi import mpi_op


def row_sparse_positions(variables, layers) -> list[int]:
    """Positions in `variables` of embedding tables (`keras.layers.Embedding` and subclasses
    such as keras_hub's `ReversibleEmbedding`), whose gradients arrive as row slices."""
    tables = {
        id(layer.embeddings)
        for layer in layers
        if isinstance(layer, keras.layers.Embedding) and _keras.has_table_variable(layer)
    }
    return [i for i, v in enumerate(variables) if id(v) in tables]


def check_kinds(grads, sparse_positions, variables) -> None:
    """Refuse row slices for a variable not known to be a table (they would be densified).

    Called while tracing: the error names the variable and stops before any update.
    """
    sparse = set(sparse_positions)
    for i, grad in enumerate(grads):
        if isinstance(grad, tf.IndexedSlices) and i not in sparse:
            raise ValueError(
                f"Variable {variables[i].path!r} receives row-sparse gradients "
                "(tf.IndexedSlices) but does not belong to a keras.layers.Embedding, so "
                "hyparflow cannot keep them sparse and would change the optimizer's update; "
                "look the rows up with a keras.layers.Embedding, or train on one process."
            )


def empty_rows(variable) -> tf.IndexedSlices:
    """A row-sparse gradient with no rows: the contribution of a rank that saw no tokens."""
    shape = tuple(variable.shape)
    return tf.IndexedSlices(
        tf.zeros((0, *shape[1:]), variable.dtype),
        tf.zeros((0,), tf.int64),
        tf.constant(shape, tf.int64),
    )


def or_empty(grad, variable):
    """`grad`, or no rows where nothing connects `variable` to the loss."""
    return empty_rows(variable) if grad is None else grad


def concat_rows(per_microbatch: list, variable):
    """One gradient from the micro-batches' gradients, as one call on their concatenated batch
    gives it: row slices concatenated in order; a dense sum if any of them is dense."""
    if not per_microbatch:
        return empty_rows(variable)
    if not all(isinstance(g, tf.IndexedSlices) for g in per_microbatch):
        return tf.add_n([tf.convert_to_tensor(g) for g in per_microbatch])
    if len(per_microbatch) == 1:
        return per_microbatch[0]
    return tf.IndexedSlices(
        tf.concat([g.values for g in per_microbatch], axis=0),
        tf.concat([tf.cast(g.indices, tf.int64) for g in per_microbatch], axis=0),
        tf.constant(tuple(variable.shape), tf.int64),
    )


def concat_microbatches(per_microbatch: list, positions: list, variables: list) -> list:
    """Each table's gradient (`concat_rows`) from per-micro-batch lists of the tables'
    gradients; `positions` are the tables' indices in `variables`."""
    return [
        concat_rows([tables[j] for tables in per_microbatch], variables[i])
        for j, i in enumerate(positions)
    ]


def in_order(count: int, dense_positions, dense, table_positions, tables) -> list:
    """One gradient list of `count` variables from the dense gradients and the tables'.

    Example:
        >>> in_order(3, [0, 2], ["a", "c"], [1], ["t"])
        ['a', 't', 'c']
    """
    grads = [None] * count
    for i, grad in zip(dense_positions, dense, strict=True):
        grads[i] = grad
    for i, grad in zip(table_positions, tables, strict=True):
        grads[i] = grad
    return grads


def reduce_rows(comm, grads: list) -> list:
    """Sum gradients over `comm` as one process would: where every rank holds row slices, all
    rows gathered in rank order; where any rank's is dense, the dense sum. Collective."""
    if comm.Get_size() == 1 or not grads:
        return list(grads)
    kinds = comm.allgather([isinstance(g, tf.IndexedSlices) for g in grads])
    reduced = []
    for i, grad in enumerate(grads):
        if all(k[i] for k in kinds):
            indices, values = gather_rows(comm, grad.indices.numpy(), grad.values.numpy())
            reduced.append(
                tf.IndexedSlices(tf.constant(values), tf.constant(indices), grad.dense_shape)
            )
        else:
            dense = tf.convert_to_tensor(grad)
            total = np.array(dense, dtype=reduction_dtype(dense.dtype))  # a private copy
            comm.Allreduce(mpi_op("IN_PLACE"), total)
            reduced.append(tf.cast(tf.constant(total), dense.dtype))
    return reduced


def values_of(grad):
    """The numbers a gradient holds (a row slice's values), e.g. to check they are finite."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def like(grad, values):
    """`grad` with its numbers replaced by `values` (same rows for a row slice)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return values
