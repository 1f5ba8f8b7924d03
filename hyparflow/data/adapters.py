"""Datasets, PyDatasets and Python generators, read through Keras's own data adapters.

Keras's adapter does what `model.fit` does with such data (class weights, PyDataset workers,
a generator's first batch, Keras's refusals and their messages). Every rank reads the same data
in the same order and keeps its own range of each global batch, so the data must be
deterministic: a `tf.data.Dataset` shuffled with a seed, a generator that yields the same on
every rank. Keras shuffles a PyDataset's batches with each process's own `random`; with
`shuffle=True` the adapter reads an ordered view instead, whose order every rank draws from the
shared seed (`SharedOrder`).
"""

from __future__ import annotations

from collections.abc import Iterator

import keras

from hyparflow.data.batches import epoch_order, global_batch


class AdapterSource:
    """A source of global batches read by a Keras data adapter; `epoch(k)` is one pass."""

    def __init__(self, adapter):
        self.adapter = adapter

    def __len__(self) -> int:
        if self.adapter.num_batches is None:
            raise TypeError("unknown length")
        return self.adapter.num_batches

    def epoch(self, epoch: int) -> Iterator:
        del epoch  # the data orders itself (a seeded Dataset, a generator, SharedOrder)
        self.adapter.on_epoch_begin()
        try:
            for batch in self.adapter.get_numpy_iterator():
                yield global_batch(batch)
        finally:
            self.adapter.on_epoch_end()


class SharedOrder(keras.utils.PyDataset):
    """A PyDataset's batches in a permutation drawn from `seed`, new after each epoch."""

    def __init__(self, dataset: keras.utils.PyDataset, seed: int):
        super().__init__(
            workers=dataset.workers,
            use_multiprocessing=dataset.use_multiprocessing,
            max_queue_size=dataset.max_queue_size,
        )
        self.dataset, self.seed, self.epochs = dataset, seed, 0
        self.order = epoch_order(len(dataset), True, seed, 0)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[int(self.order[index])]

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()
        self.epochs += 1
        self.order = epoch_order(len(self.dataset), True, self.seed, self.epochs)
