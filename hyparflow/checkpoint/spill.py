"""Arrays kept on this node's disk instead of in memory, read back as memory maps.

After a split fit rank 0 keeps every rank's optimizer state for the files it may save
(engine/loops/optimizer_gather.py). Held as arrays, that is the whole optimizer state resident
on one rank at the end of every fit, more than any rank trained with. Spilled, it costs the
disk and the page cache, which the kernel reclaims, and only a save reads it back (the whole
optimizer it builds then is the price of the file the user asked for). Bytes are written with
`write`, never through a mapping, so spilling adds nothing to the process's resident set; the
maps are made when the arrays are first read.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np

_ALIGN = 64  # each array starts on a cache line of the file


class Spill:
    """An append-only file of named arrays in a temporary folder of `folder` (default: the
    system's temporary folder, `TMPDIR`), removed by `close` or when the object is collected.

    Example:
        >>> spill = Spill()
        >>> spill.write("a", np.arange(3.0))
        >>> spill.write("b", np.ones((2, 2), np.float16))
        >>> spill.write("step", np.array(7))
        >>> arrays = spill.arrays()
        >>> arrays["a"].tolist(), arrays["b"].dtype, arrays["b"].shape, arrays["step"].shape
        ([0.0, 1.0, 2.0], dtype('float16'), (2, 2), ())
        >>> spill.close()
    """

    def __init__(self, folder: str | None = None):
        self._folder = tempfile.TemporaryDirectory(prefix="hyparflow-spill-", dir=folder)
        self.path = os.path.join(self._folder.name, "arrays.bin")
        self._file = open(self.path, "wb")  # noqa: SIM115 - open until `arrays`
        self._entries: list[tuple[str, int, tuple, np.dtype]] = []
        self.nbytes = 0

    def write(self, key: str, array: np.ndarray) -> None:
        """Append `array` under `key` (a later key of the same name wins on reading)."""
        data = np.asarray(array, order="C")  # 0-d stays 0-d (ascontiguousarray makes it 1-d)
        pad = -self.nbytes % _ALIGN
        self._file.write(b"\0" * pad)
        self.nbytes += pad
        self._entries.append((key, self.nbytes, data.shape, data.dtype))
        self._file.write(data.reshape(-1).view(np.uint8).data)
        self.nbytes += data.nbytes

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array written, read-only views of one memory map of the file (nothing more
        may be written)."""
        self._file.close()
        if not self.nbytes:
            return {key: np.empty(shape, dtype) for key, _, shape, dtype in self._entries}
        with open(self.path, "rb") as file:  # the map outlives the file object
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        return {
            key: np.frombuffer(mapped, dtype, int(np.prod(shape)), start).reshape(shape)
            for key, start, shape, dtype in self._entries
        }

    def close(self) -> None:
        self._file.close()
        self._folder.cleanup()
