"""Row-sparse gradients (an embedding's touched rows) gathered across ranks, in rank order.

An `Embedding` table's gradient is a list of (row index, row value) pairs, one per token of
the batch, duplicates included. Keras's optimizers apply such gradients with sparse
semantics (Adam's second moment squares each pair's value, not the summed row), so summing
them densely across replicas is not what one process computes. Gathering every rank's pairs,
in rank order, gives each rank exactly the pairs one process would see for the global batch.
Its cost is the batch's tokens times the row width, where a dense reduction costs the whole
table (docs/engine.md, "Sparse gradients").
"""

from __future__ import annotations

import math

import numpy as np


def gather_rows(
    comm, indices: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Every rank's `indices` (1-D) and `values` (rows) concatenated in rank order, on every rank,
    and how many rows each rank gave.

    Values travel as raw bytes (MPI has no bfloat16), so any dtype works; all ranks must pass
    the same dtypes and row shape. Collective over `comm`.

    Example:
        idx, val, counts = gather_rows(comm, np.array([3, 7]), np.ones((2, 16), "float32"))
    """
    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    indices = np.ascontiguousarray(indices, dtype=np.int64)
    values = np.ascontiguousarray(values)
    counts = comm.allgather(len(indices))
    total = sum(counts)
    all_indices = np.empty(total, np.int64)
    comm.Allgatherv(indices, [all_indices, counts, _offsets(counts), MPI.INT64_T])
    row_bytes = math.prod(values.shape[1:]) * values.dtype.itemsize
    all_values = np.empty((total, *values.shape[1:]), values.dtype)
    byte_counts = [c * row_bytes for c in counts]
    comm.Allgatherv(
        [values.view(np.uint8).reshape(-1), MPI.BYTE],
        [all_values.view(np.uint8).reshape(-1), byte_counts, _offsets(byte_counts), MPI.BYTE],
    )
    return all_indices, all_values, counts


def _offsets(counts: list[int]) -> list[int]:
    """Where each rank's part starts in the concatenation.

    Example:
        >>> _offsets([2, 0, 3])
        [0, 2, 2]
    """
    return [sum(counts[:i]) for i in range(len(counts))]
