"""Row-sparse gradients (`tf.IndexedSlices`) handed to the optimizer as one process would.

An `Embedding` table's gradient is `tf.IndexedSlices`: one (row index, row value) pair per
token, duplicates included, and Keras's optimizers apply it with sparse semantics (Adam squares
each pair's value; clipping norms sum the pairs' squares). Densifying it, as a dense reduction
does, changes the update. So these gradients stay row slices end to end: micro-batches
concatenate their pairs in order, replicas gather them in rank order, and the optimizer sees
the very pairs of the global batch (docs/engine.md, "Sparse gradients").

Which variables receive row slices, and how their rows relate to the batch, is found once per
model by tracing its gradient (`engine/keras_semantics/sparse_probe.py`, `RowKinds`): rows looked up
with the batch's own indices (token ids) come one per sample, and pieces of the batch concatenate
theirs; rows looked up with indices shared by the whole batch (ViT's position ids broadcast over the
batch, a relative position table) come once per call with values summed over the batch,
and pieces of the batch add their values, row by row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from hyparflow import _keras
from hyparflow.comm.allreduce import reduction_dtype
from hyparflow.comm.rows import gather_rows
from hyparflow.engine.gradients.mpi import mpi_op


@dataclass(frozen=True)
class RowKinds:
    """The variables of a model whose gradients are row slices (`tf.IndexedSlices`), by id.

    `per_sample`: rows looked up with the batch's own indices; a piece of the batch has its own
    rows, and the batch's are the pieces' concatenated. `per_batch`: rows looked up with indices
    the whole batch shares; every piece has the same rows, and the batch's values are their sum.
    `complete`: every variable was classified by tracing (`sparse_probe.py`); where it is not,
    row slices of a variable outside these sets must be refused where they show.
    """

    per_sample: frozenset = frozenset()
    per_batch: frozenset = frozenset()
    complete: bool = False

    def has_rows(self, variable) -> bool:
        return id(variable) in self.per_sample or id(variable) in self.per_batch

    def is_per_batch(self, variable) -> bool:
        return id(variable) in self.per_batch

    def with_shards(self, model, shards: dict) -> RowKinds:
        """These kinds and, for each split variable of `model` (`shards`: its path -> this
        rank's shard, tensor or expert), its shard's, which are its whole variable's."""
        whole = {v.path: v for v in model.trainable_variables}
        pairs = [(id(whole[path]), id(shard)) for path, shard in shards.items() if path in whole]
        return dataclasses.replace(
            self,
            per_sample=self.per_sample | {s for w, s in pairs if w in self.per_sample},
            per_batch=self.per_batch | {s for w, s in pairs if w in self.per_batch},
        )


UNPROBED = RowKinds()


def row_sparse_positions(variables, layers, kinds: RowKinds = UNPROBED) -> list[int]:
    """Positions in `variables` of those whose gradients arrive as row slices: embedding tables
    (`keras.layers.Embedding` and subclasses such as keras_hub's `ReversibleEmbedding`) and
    whatever else `kinds` found (a plain variable gathered, as T5's relative position bias)."""
    tables = {
        id(layer.embeddings)
        for layer in layers
        if isinstance(layer, keras.layers.Embedding) and _keras.has_table_variable(layer)
    }
    return [i for i, v in enumerate(variables) if id(v) in tables or kinds.has_rows(v)]


def per_batch_flags(variables, positions, kinds: RowKinds) -> list[bool]:
    """For each position in `positions`, whether that variable's rows come once per batch."""
    return [kinds.is_per_batch(variables[i]) for i in positions]


def check_kinds(grads, sparse_positions, variables) -> None:
    """Refuse row slices for a variable not known to be a table (they would be densified).

    Called while tracing: the error names the variable and stops before any update.
    """
    sparse = set(sparse_positions)
    for i, grad in enumerate(grads):
        if isinstance(grad, tf.IndexedSlices) and i not in sparse:
            raise ValueError(
                f"Variable {variables[i].path!r} receives row-sparse gradients "
                "(tf.IndexedSlices) that hyparflow could not classify before training (its "
                "gradient could not be traced at the data's shapes), so it cannot keep them as "
                "one process would; train on one process, or report the model."
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


def concat_rows(per_microbatch: list, variable, per_batch: bool = False):
    """One gradient from the micro-batches' gradients, as one call on their concatenated batch
    gives it: row slices concatenated in order (or, `per_batch`, added row by row); a dense sum
    if any of them is dense."""
    if not per_microbatch:
        return empty_rows(variable)
    if not all(isinstance(g, tf.IndexedSlices) for g in per_microbatch):
        return tf.add_n([tf.convert_to_tensor(g) for g in per_microbatch])
    if per_batch:
        return add_rows(per_microbatch, tuple(variable.shape), variable.path)
    if len(per_microbatch) == 1:
        return per_microbatch[0]
    return tf.IndexedSlices(
        tf.concat([g.values for g in per_microbatch], axis=0),
        tf.concat([tf.cast(g.indices, tf.int64) for g in per_microbatch], axis=0),
        tf.constant(tuple(variable.shape), tf.int64),
    )


def add_rows(pieces: list, dense_shape, name: str = "a gathered variable"):
    """Row slices that pieces of one batch looked up alike (indices shared by the batch, in
    the same order), as the whole batch has them: one piece's indices, the values summed. A
    piece without rows (it did not run the lookup) adds nothing. `dense_shape`: the
    variable's shape."""
    present = [g for g in pieces if int(tf.shape(g.indices)[0]) > 0] or pieces[:1]
    first = tf.cast(present[0].indices, tf.int64)
    for g in present[1:]:
        _check_same_rows(first.numpy(), tf.cast(g.indices, tf.int64).numpy(), name)
    values = tf.add_n([g.values for g in present]) if len(present) > 1 else present[0].values
    return tf.IndexedSlices(values, first, tf.cast(dense_shape, tf.int64))


def _check_same_rows(expected: np.ndarray, got: np.ndarray, name: str) -> None:
    if not np.array_equal(expected, got):
        raise ValueError(
            f"Variable {name!r}: its rows are looked up once per batch, but two pieces "
            f"of one batch looked up different rows ({len(expected)} and {len(got)}); its "
            "lookup depends on the data, so hyparflow cannot add the pieces' rows as one "
            "process would."
        )


def concat_microbatches(
    per_microbatch: list, positions: list, variables: list, per_batch: list | None = None
) -> list:
    """Each table's gradient (`concat_rows`) from per-micro-batch lists of the tables'
    gradients; `positions` are the tables' indices in `variables`, `per_batch` their flags
    (`per_batch_flags`; None: all per sample)."""
    per_batch = per_batch or [False] * len(positions)
    return [
        concat_rows([tables[j] for tables in per_microbatch], variables[i], per_batch[j])
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


def reduce_rows(comm, grads: list, per_batch: list | None = None) -> list:
    """Sum gradients over `comm` as one process would: where every rank holds row slices, all
    rows gathered in rank order (or, where `per_batch` flags it, added row by row:
    `add_rows`); where any rank's is dense, the dense sum. Collective."""
    if comm.Get_size() == 1 or not grads:
        return list(grads)
    per_batch = per_batch or [False] * len(grads)
    kinds = comm.allgather([isinstance(g, tf.IndexedSlices) for g in grads])
    reduced = []
    for i, grad in enumerate(grads):
        if all(k[i] for k in kinds):
            reduced.append(_gathered(comm, grad, per_batch[i]))
        else:
            dense = tf.convert_to_tensor(grad)
            total = np.array(dense, dtype=reduction_dtype(dense.dtype))  # a private copy
            comm.Allreduce(mpi_op("IN_PLACE"), total)
            reduced.append(tf.cast(tf.constant(total), dense.dtype))
    return reduced


def _gathered(comm, grad, per_batch: bool):
    """Every rank's rows of `grad` in rank order, or added (`per_batch`). Collective."""
    indices, values, counts = gather_rows(comm, grad.indices.numpy(), grad.values.numpy())
    if not per_batch:
        return tf.IndexedSlices(tf.constant(values), tf.constant(indices), grad.dense_shape)
    bounds = np.cumsum([0, *counts])
    pieces = [
        tf.IndexedSlices(values[a:b], indices[a:b], grad.dense_shape)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return add_rows(pieces, grad.dense_shape)


def values_of(grad):
    """The numbers a gradient holds (a row slice's values), e.g. to check they are finite."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def like(grad, values):
    """`grad` with its numbers replaced by `values` (same rows for a row slice)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return values
