"""A checkpoint's entries read one at a time from its files, pieces joined when asked for.

Resuming a model bigger than one rank must not load the whole checkpoint on every rank: each
takes only the entries of its own stage and shard, and `hf.export` writes a model variable by
variable. `np.load` of an `.npz` reads an array only when it is indexed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hyparflow.checkpoint.state import join_pieces, join_ranges, split_key, split_slice_key


class LazyState(Mapping):
    """The entries of a checkpoint's `.npz` files (`paths`), as one mapping of joined keys:
    ZeRO's flat ranges (`#`) of each entry or tensor piece first, then tensor pieces (`@`).

    For example:
        state = LazyState(["ckpt-10/stage-0.npz", "ckpt-10/stage-1.npz"])
        state["w/0"].shape  # (784, 512)
    """

    def __init__(self, paths):
        self._files = [np.load(path) for path in paths]
        self._ranges: dict = {}  # entry or piece key -> (shape, [(start, stop, file, key)])
        self._whole: dict = {}  # key -> file
        self._pieces: dict = {}  # base key -> {shard: (parts, axis, piece key)}
        for archive in self._files:
            for key in archive.files:
                entry, span = split_slice_key(key)
                if span is not None:
                    start, stop, dims = span
                    self._ranges.setdefault(entry, (dims, []))[1].append(
                        (start, stop, archive, key)
                    )
                elif key not in self._ranges:
                    self._whole[key] = archive
        for entry in [*self._whole, *self._ranges]:
            base, where = split_key(entry)
            if where is not None:
                shard, parts, axis = where
                self._pieces.setdefault(base, {})[shard] = (parts, axis, entry)

    def _entry(self, key: str):
        """An entry or tensor piece as written, its ZeRO ranges joined."""
        if key in self._whole:
            return self._whole[key][key]
        dims, found = self._ranges[key]
        return join_ranges(key, dims, [(a, b, f[k]) for a, b, f, k in found])

    def __getitem__(self, key: str):
        if key in self._pieces:
            found = self._pieces[key]
            return join_pieces(key, {t: (p, a, self._entry(k)) for t, (p, a, k) in found.items()})
        if key in self._whole or key in self._ranges:
            return self._entry(key)
        raise KeyError(key)

    def _keys(self) -> list:
        pieces = {k for found in self._pieces.values() for _, _, k in found.values()}
        return [k for k in [*self._whole, *self._ranges] if k not in pieces] + list(self._pieces)

    def __contains__(self, key) -> bool:
        return key in self._pieces or (
            (key in self._whole or key in self._ranges) and split_key(key)[1] is None
        )

    def __iter__(self):
        yield from self._keys()

    def __len__(self) -> int:
        return len(self._keys())

    def close(self) -> None:
        for archive in self._files:
            archive.close()
