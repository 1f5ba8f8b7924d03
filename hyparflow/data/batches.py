"""Global batches in one shared deterministic order, each replica's shard, and micro-batches.

Every rank sees the same inputs (the user's script loads them on every rank) and derives the
same sample order from a shared seed, so no targets or inputs travel between ranks: the first
stage reads the inputs of its replica's shard, the last stage reads the targets and sample
weights of the same shard. See docs/engine.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from keras import tree


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous parts of `total` items, as even as possible, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split_bounds(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when `total` items are split by `split_sizes`."""
    sizes = split_sizes(total, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def check_divisible(batch_size: int, replicas: int, microbatches: int) -> None:
    """A full global batch must split evenly over replicas and then micro-batches."""
    if batch_size % (replicas * microbatches):
        good = replicas * microbatches
        raise ValueError(
            f"batch_size={batch_size} does not split evenly into {replicas} replica(s) x "
            f"{microbatches} micro-batch(es); use a multiple of {good} "
            f"(e.g. {max(good, batch_size // good * good)}) or change num_microbatches."
        )


def epoch_order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """Sample order of one epoch: identity, or a permutation every rank derives identically."""
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def num_samples_of(structure) -> int:
    """Leading dimension shared by every array of a (nested) input structure."""
    sizes = {len(a) for a in tree.flatten(structure) if a is not None}
    if len(sizes) != 1:
        raise ValueError(
            f"All input arrays must have the same number of samples; got sizes {sorted(sizes)}. "
            "Make x, y and sample_weight the same length."
        )
    return sizes.pop()


def take(structure, index):
    """Select samples `index` (slice or integer array) from every array of a structure."""
    return tree.map_structure(lambda a: None if a is None else np.asarray(a)[index], structure)


@dataclass
class GlobalBatch:
    """One step's global batch: its size, and the data of any [start, stop) range of it."""

    size: int
    _select: object  # callable (start, stop) -> (x, y, sample_weight)

    def part(self, start: int, stop: int):
        return self._select(start, stop)


class ArraySource:
    """Numpy (or nested) arrays: each rank gathers only the samples of its own range."""

    def __init__(self, x, y=None, sample_weight=None, batch_size=32, shuffle=False, seed=0):
        self.data = (x, y, sample_weight)
        self.num_samples = num_samples_of([a for a in self.data if a is not None])
        if self.num_samples == 0:
            raise ValueError("The input data is empty; pass at least one sample.")
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def epoch(self, epoch: int) -> Iterator[GlobalBatch]:
        order = epoch_order(self.num_samples, self.shuffle, self.seed, epoch)
        for start in range(0, self.num_samples, self.batch_size):
            indices = order[start : start + self.batch_size]
            yield GlobalBatch(len(indices), lambda a, b, idx=indices: take(self.data, idx[a:b]))


def global_batch(batch) -> GlobalBatch:
    """A batch that arrived whole (x, (x,), (x, y) or (x, y, sample_weight)) as a GlobalBatch."""
    data = unpack(batch)
    size = num_samples_of([a for a in data if a is not None])
    return GlobalBatch(size, lambda a, b: take(data, slice(a, b)))


def unpack(batch):
    """(x,), (x, y) or (x, y, sample_weight) as a 3-tuple, like Keras's data adapters (a list
    counts as a tuple; anything else is x alone: a Dataset given as validation_data)."""
    if isinstance(batch, list):
        batch = tuple(batch)
    if isinstance(batch, tuple):
        if len(batch) == 1:
            return batch[0], None, None
        if len(batch) == 2:
            return batch[0], batch[1], None
        if len(batch) == 3:
            return batch
        raise ValueError(
            f"A data batch must be x, (x,), (x, y) or (x, y, sample_weight); got a tuple of "
            f"{len(batch)} elements."
        )
    return batch, None, None
