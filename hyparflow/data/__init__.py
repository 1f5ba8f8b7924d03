"""Training data: shared-order global batches, replica shards, micro-batches, input sources."""

from hyparflow.data.adapters import AdapterSource
from hyparflow.data.batches import (
    ArraySource,
    GlobalBatch,
    check_divisible,
    epoch_order,
    global_batch,
    num_samples_of,
    split_bounds,
    split_sizes,
    take,
    unpack,
)
from hyparflow.data.hdf5 import HDF5
from hyparflow.data.sources import make_source

__all__ = [
    "AdapterSource",
    "ArraySource",
    "GlobalBatch",
    "HDF5",
    "check_divisible",
    "epoch_order",
    "global_batch",
    "make_source",
    "num_samples_of",
    "split_bounds",
    "split_sizes",
    "take",
    "unpack",
]
