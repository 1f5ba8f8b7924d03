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

__all__ = [
    "ArraySource",
    "BatchedSource",
    "GlobalBatch",
    "check_divisible",
    "epoch_order",
    "make_source",
    "num_samples_of",
    "piece_bounds",
    "split_sizes",
    "take",
    "unpack",
]
