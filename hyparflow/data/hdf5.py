"""HDF5 input (h5py): each rank reads only the rows of its own shard of every global batch."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
from keras import tree

from hyparflow.data.batches import GlobalBatch, epoch_order
from hyparflow.data.hdf5_keras import HDF5Batches


def _h5py():
    try:
        import h5py
    except ImportError as error:  # h5py is the optional extra "io"
        raise ImportError(
            "hf.data.HDF5 needs h5py; install it with `pip install hyparflow[io]` "
            "(or `pip install h5py`)."
        ) from error
    return h5py


def read_rows(dataset, indices: np.ndarray) -> np.ndarray:
    """Rows `indices` of an h5py dataset, in that order, reading nothing else."""
    indices = np.asarray(indices, dtype=np.int64)
    count = len(indices)
    if count == 0:
        return np.empty((0, *dataset.shape[1:]), dtype=dataset.dtype)
    first = int(indices[0])
    if int(indices[-1]) - first + 1 == count and np.all(np.diff(indices) == 1):
        return dataset[first : first + count]  # a contiguous range: one plain read
    # h5py's fancy indexing needs increasing indices: read sorted, then restore the order.
    order = np.argsort(indices, kind="stable")
    rows = dataset[indices[order]]
    restored = np.empty_like(rows)
    restored[order] = rows
    return restored


class Rows:
    """Rows `indices` of one dataset, read only when sliced (or converted to an array).

    The engine slices a replica's shard into micro-batches, and only the first pipeline stage
    slices the inputs and only the last the targets: a stage never reads what it does not use.
    """

    def __init__(self, dataset, indices: np.ndarray):
        self.dataset = dataset
        self.indices = indices
        self.shape = (len(indices), *dataset.shape[1:])
        self.dtype = dataset.dtype

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, cut) -> np.ndarray:
        selected = self.indices[cut]
        if np.ndim(selected) == 0:
            return self.dataset[int(selected)]
        return read_rows(self.dataset, selected)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = read_rows(self.dataset, self.indices)
        return rows if dtype is None else rows.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"Rows({self.dataset.name!r}, {len(self)} rows)"


class HDF5:
    """Training data in an HDF5 file, read batch by batch, for datasets larger than memory.

    `x` names one dataset, or a list or dict of names for a multi-input model; `y` (same forms)
    and `sample_weight` (one name) are optional. Every dataset must have the same number of rows
    (first dimension). Pass it to `hf.fit` as `x`: every rank opens the file and reads only the
    rows of its replica's shard of each global batch (the first pipeline stage reads only `x`,
    the last only `y` and `sample_weight`). `open_options` go to `h5py.File` (e.g.
    `locking=False` on file systems without locks, `rdcc_nbytes` for the chunk cache).

    For example:
        data = hf.data.HDF5("train.h5", x="images", y="labels")
        history = hf.fit(model, data, batch_size=64, epochs=2, strategy="data")
    """

    def __init__(self, path, x, y=None, sample_weight=None, **open_options):
        self.path = os.fspath(path)
        self.names = (x, y, sample_weight)
        self.open_options = open_options
        self._file = None
        self.datasets = tree.map_structure(self._dataset, self.names)
        self.num_samples = self._common_length()

    def _open(self):
        if self._file is None:
            self._file = _h5py().File(self.path, "r", **self.open_options)
        return self._file

    def _dataset(self, name):
        if name is None:
            return None
        h5py = _h5py()
        file = self._open()
        found = file.get(name)
        if not isinstance(found, h5py.Dataset):
            available = []
            file.visititems(
                lambda key, obj: available.append(key) if isinstance(obj, h5py.Dataset) else None
            )
            what = "is not a dataset" if found is not None else "does not exist"
            raise ValueError(
                f"HDF5 dataset {name!r} {what} in {self.path}; the file's datasets are "
                f"{sorted(available)}. Pass one of them."
            )
        if found.ndim == 0:
            raise ValueError(
                f"HDF5 dataset {name!r} in {self.path} is a scalar; samples must be its rows."
            )
        return found

    def _common_length(self) -> int:
        lengths = {d.name: d.shape[0] for d in tree.flatten(self.datasets) if d is not None}
        if len(set(lengths.values())) != 1:
            raise ValueError(
                f"HDF5 datasets in {self.path} have different numbers of rows: {lengths}. "
                "x, y and sample_weight must have one row per sample."
            )
        count = lengths.popitem()[1]
        if count == 0:
            raise ValueError(f"HDF5 datasets in {self.path} are empty; pass at least one sample.")
        return count

    def rows(self, indices: np.ndarray):
        """(x, y, sample_weight) of samples `indices`, as `Rows` views read when sliced."""
        return tree.map_structure(lambda d: None if d is None else Rows(d, indices), self.datasets)

    def read(self, indices: np.ndarray):
        """(x, y, sample_weight) of samples `indices`, read now as numpy arrays."""
        return tree.map_structure(lambda r: None if r is None else r[:], self.rows(indices))

    def as_source(self, batch_size=32, shuffle=False, seed=0) -> HDF5Source:
        """The batch source `hf.fit`, `hf.evaluate` and `hf.predict` iterate (see data/)."""
        return HDF5Source(self, batch_size, shuffle, seed)

    def as_keras(self, batch_size=32, shuffle=False, seed=0):
        """The same batches as a `keras.utils.PyDataset` for plain `model.fit` on one process
        (pass `shuffle=False` to `model.fit`: the samples are shuffled here)."""

        return HDF5Batches(self.as_source(batch_size, shuffle, seed))

    def close(self) -> None:
        """Close the file; build a new `HDF5` to read it again."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        x, y, sw = self.names
        return f"HDF5({self.path!r}, x={x!r}, y={y!r}, sample_weight={sw!r})"


class HDF5Source:
    """Global batches of an `HDF5` file in the shared epoch order; rows are read per shard."""

    def __init__(self, data: HDF5, batch_size: int, shuffle: bool, seed: int):
        self.data = data
        self.num_samples = data.num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.num_samples, self.shuffle, self.seed, epoch)

    def epoch(self, epoch: int) -> Iterator[GlobalBatch]:
        order = self.order(epoch)
        for start in range(0, self.num_samples, self.batch_size):
            indices = order[start : start + self.batch_size]
            yield GlobalBatch(len(indices), lambda a, b, i=indices: self.data.rows(i[a:b]))
