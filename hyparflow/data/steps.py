"""Keras 3's `steps_per_epoch`: epochs cut from passes over the data that go on across epochs.

As Keras's `EpochIterator` does (keras/src/trainers/epoch_iterator.py): with `steps_per_epoch`,
an epoch takes that many batches from the current pass over the data and the next epoch goes on
where it stopped. Once a pass has given all its batches, the epoch ends there, even if short,
and the next epoch starts a new pass (reshuffled). A pass of unknown length that runs out ends
its epoch, and its length is known from then on. Without `steps_per_epoch`, every epoch is one
whole pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

RAN_OUT = (
    "Your input ran out of data; interrupting training. Make sure that your dataset or generator "
    "can generate at least `steps_per_epoch * epochs` batches."
)


class EpochSteps:
    """The epochs of `source` (anything with `epoch(k)`, one pass k) for `steps_per_epoch`."""

    def __init__(self, source, steps_per_epoch: int | None, first_epoch: int = 0):
        self.source, self.steps = source, steps_per_epoch
        self._pass, self._passes, self._seen, self._epochs = None, 0, 0, first_epoch
        try:
            self._length = len(source)
        except TypeError:  # a generator, or a dataset of unknown cardinality
            self._length = None

    def __len__(self) -> int:
        return self.steps if self.steps is not None else len(self.source)

    def epoch(self, epoch: int) -> Iterator:
        """The batches of epoch `epoch`. Epochs from `first_epoch` (fit's `initial_epoch`) not yet
        taken are taken first, unread: a run resumed at epoch k continues where the
        uninterrupted run would be."""
        if self.steps is None:
            yield from self.source.epoch(epoch)
            return
        while self._epochs < epoch:  # resuming: replay the epochs before, unread (lazy batches)
            for _ in self._next_epoch():
                pass
        yield from self._next_epoch()

    def _next_epoch(self) -> Iterator:
        self._epochs += 1
        if self._pass is None:
            self._pass, self._seen = iter(self.source.epoch(self._passes)), 0
            self._passes += 1
        for _ in range(self.steps):
            if self._length is not None and self._seen >= self._length:
                warnings.warn(RAN_OUT, stacklevel=2)
                break
            self._seen += 1
            batch = next(self._pass, None)
            if batch is None:
                self._length = self._length or self._seen
                warnings.warn(RAN_OUT, stacklevel=2)
                self._pass = None
                return
            yield batch
        if self._length is not None and self._seen >= self._length:
            self._pass = None
