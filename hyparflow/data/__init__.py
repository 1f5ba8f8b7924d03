"""Training data: shared-order global batches, replica shards, micro-batches, input sources."""

from hyparflow.data.batches import (
    ArraySource,
    BatchedSource,
    GlobalBatch,
    check_divisible,
    epoch_order,
    make_source,
    num_samples_of,
    piece_bounds,
    split_sizes,
    take,
    unpack,
)
from hyparflow.data.hdf5 import HDF5

__all__ = [
    "ArraySource",
    "BatchedSource",
    "GlobalBatch",
    "HDF5",
    "check_divisible",
    "epoch_order",
    "make_source",
    "num_samples_of",
    "piece_bounds",
    "split_sizes",
    "take",
    "unpack",
]
