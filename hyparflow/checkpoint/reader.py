"""A checkpoint's entries read one at a time from its files, pieces joined when asked for.

Resuming a model bigger than one rank must not load the whole checkpoint on every rank: each
takes only the entries of its own stage and shard, and `hf.export` writes a model variable by
variable. `np.load` of an `.npz` reads an array only when it is indexed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hyparflow.checkpoint.state import join_pieces, split_key


class LazyState(Mapping):
    """The entries of a checkpoint's `.npz` files (`paths`), as one mapping of joined keys.

    Example:
        >>> state = LazyState(["ckpt-10/stage-0.npz", "ckpt-10/stage-1.npz"])
        >>> state["w/0"].shape
        (784, 512)
    """

    def __init__(self, paths):
        self._files = [np.load(path) for path in paths]
        self._whole: dict = {}  # key -> file
        self._pieces: dict = {}  # base key -> {shard: (parts, axis, file, key)}
        for archive in self._files:
            for key in archive.files:
                base, where = split_key(key)
                if where is None:
                    self._whole[key] = archive
                else:
                    shard, parts, axis = where
                    self._pieces.setdefault(base, {})[shard] = (parts, axis, archive, key)

    def __getitem__(self, key: str):
        if key in self._whole:
            return self._whole[key][key]
        found = self._pieces[key]  # KeyError for an entry the checkpoint lacks
        return join_pieces(key, {t: (p, a, f[k]) for t, (p, a, f, k) in found.items()})

    def __contains__(self, key) -> bool:
        return key in self._whole or key in self._pieces

    def __iter__(self):
        yield from self._whole
        yield from self._pieces

    def __len__(self) -> int:
        return len(self._whole) + len(self._pieces)

    def close(self) -> None:
        for archive in self._files:
            archive.close()
