"""A cheap digest of the training data, compared across ranks before training starts.

Every rank reads its share of each global batch from its own copy of the data, so the copies
must be equal: a shuffle with an unseeded generator on each rank would pair one rank's inputs
with another's targets and train in silence. The digest covers each array's shape and dtype and
up to `ROWS` rows spread over it (the first, the last and evenly between), so it costs the same
for any size of data; for data read whole (a Dataset, a PyDataset), the first batch.
"""

from __future__ import annotations

import hashlib

import numpy as np
from keras import tree

ROWS = 64


def array_digest(structure) -> str:
    """Digest of every array of a nested structure: shapes, dtypes, `ROWS` sampled rows."""
    digest = hashlib.blake2b(digest_size=16)
    for array in tree.flatten(structure):
        if array is None:
            digest.update(b"none")
            continue
        array = np.asarray(array)
        digest.update(f"{array.shape}{array.dtype}".encode())
        if array.ndim and len(array):
            rows = np.unique(np.linspace(0, len(array) - 1, min(ROWS, len(array))).astype(int))
            digest.update(np.ascontiguousarray(array[rows]).tobytes())
        else:
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def differing_ranks(digests: list[str]) -> list[list[int]]:
    """Ranks grouped by digest, largest group first; one group when all agree."""
    groups: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    return sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))


def mismatch_message(groups: list[list[int]]) -> str:
    """The error for ranks whose data differ (`groups` from `differing_ranks`)."""
    listed = " vs ".join(str(ranks) for ranks in groups)
    return (
        f"The training data differs across ranks: ranks {listed}. Every rank "
        "reads its share of each batch from its own copy, so every rank must load the same x, "
        "y and sample_weight in the same order: seed any shuffle or split (e.g. "
        "np.random.default_rng(0)), or shuffle with hf.fit(shuffle=True), which every rank "
        "does alike. Pass check_data=False only if the ranks' data differ on purpose."
    )


def data_digest(x, y=None, sample_weight=None) -> str | None:
    """Digest of what `fit` was given: arrays, or a Dataset's or PyDataset's first batch; None
    for what cannot be read twice (a generator) or reads itself (hf.data.HDF5)."""
    import keras
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        return array_digest(next(iter(x.take(1).as_numpy_iterator()), None))
    if isinstance(x, keras.utils.PyDataset):
        return array_digest(x[0]) if x.num_batches != 0 else None
    if hasattr(x, "as_source") or hasattr(x, "__next__"):
        return None
    return array_digest((x, y, sample_weight))
