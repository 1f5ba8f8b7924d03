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

import keras
import numpy as np
import tensorflow as tf
from keras import tree


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous pieces of `total` items, as even as possible, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def piece_bounds(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece `index` when `total` items are split by `split_sizes`."""
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


class BatchedSource:
    """Data that arrives already batched (tf.data.Dataset, PyDataset): every rank iterates it
    identically and keeps its own range of each batch. The dataset must be deterministic."""

    def __init__(self, batches_factory, length=None):
        self._factory = batches_factory
        self._length = length

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("unknown length")
        return self._length

    def epoch(self, epoch: int) -> Iterator[GlobalBatch]:
        for batch in self._factory(epoch):
            x, y, sw = unpack(batch)
            batch_data = (x, y, sw)
            size = num_samples_of([a for a in batch_data if a is not None])
            yield GlobalBatch(size, lambda a, b, d=batch_data: take(d, slice(a, b)))


def unpack(batch):
    """(x,), (x, y) or (x, y, sample_weight) as a 3-tuple, like Keras's data adapters."""
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


def make_source(x, y=None, sample_weight=None, *, batch_size=None, shuffle=False, seed=0):
    """A batch source for numpy/nested arrays, a `tf.data.Dataset` or a `keras.utils.PyDataset`.

    Arrays are batched here (`batch_size`, default 32); datasets come batched already and must
    then be iterated identically on every rank (no unseeded shuffling).
    """

    if hasattr(x, "as_source"):  # hyparflow's own readers (e.g. hf.data.HDF5) batch themselves
        _no_separate_targets(y, sample_weight, None, type(x).__name__)
        return x.as_source(batch_size=batch_size or 32, shuffle=shuffle, seed=seed)
    if isinstance(x, tf.data.Dataset):
        _no_separate_targets(y, sample_weight, batch_size, "a tf.data.Dataset")
        cardinality = int(x.cardinality())
        length = cardinality if cardinality >= 0 else None
        return BatchedSource(lambda epoch: x.as_numpy_iterator(), length)
    if isinstance(x, keras.utils.PyDataset):
        _no_separate_targets(y, sample_weight, batch_size, "a keras.utils.PyDataset")

        def batches(epoch):
            order = epoch_order(len(x), shuffle, seed, epoch)
            for i in order:
                yield x[int(i)]
            x.on_epoch_end()

        return BatchedSource(batches, len(x))
    return ArraySource(x, y, sample_weight, batch_size=batch_size or 32, shuffle=shuffle, seed=seed)


def _no_separate_targets(y, sample_weight, batch_size, kind: str) -> None:
    if y is not None or sample_weight is not None:
        raise ValueError(f"With {kind} as x, pass no y or sample_weight: the data yields them.")
    if batch_size is not None:
        raise ValueError(f"With {kind} as x, pass no batch_size: the data is already batched.")
