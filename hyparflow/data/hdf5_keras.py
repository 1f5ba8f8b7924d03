"""An HDF5 batch source as a `keras.utils.PyDataset`, for plain `model.fit` on one process."""

from __future__ import annotations

import keras


class HDF5Batches(keras.utils.PyDataset):
    """Batch `i` of the current epoch's order, read from the file when Keras asks for it.

    The order is reshuffled per epoch exactly as on many ranks (`epoch_order`), so one process
    sees the same batches as a multi-rank run; give `model.fit` `shuffle=False`.
    """

    def __init__(self, source):
        super().__init__()
        self.source = source
        self.epoch_index = 0
        self._order = source.order(0)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        size = self.source.batch_size
        indices = self._order[index * size : (index + 1) * size]
        x, y, sample_weight = self.source.data.read(indices)
        if sample_weight is not None:
            return x, y, sample_weight
        return (x,) if y is None else (x, y)

    def on_epoch_end(self) -> None:
        self.epoch_index += 1
        self._order = self.source.order(self.epoch_index)
