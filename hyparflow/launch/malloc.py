"""Keep TensorFlow's large CPU temporaries in glibc's heap, so ranks sharing a node keep pace.

Used only when the user opts in (`hf.Strategy(tune_process=True)`, `hyparflow.process_tuning`).

TensorFlow's CPU allocator takes every temporary (activations, gradients, concatenations)
from `malloc`. glibc serves blocks above its mmap threshold (128 KiB, rising adaptively to at
most 32 MiB) with a fresh `mmap` and returns them with `munmap`, so each step faults all of its
activation pages in again, and processes doing so at once contend in the kernel
(docs/notes/benchmarks.md). The fix is `mallopt`, which changes the running process
(the `MALLOC_MMAP_THRESHOLD_` environment variables would need to be set before Python starts).

Blocks above the largest threshold glibc accepts (32 MiB: big activations, flat gradients)
are kept in the heap too, by allowing no separate mappings at all (`M_MMAP_MAX` 0): their
pages then stay mapped from step to step, which also lets `hyparflow.comm.hugepages` back
them with huge pages once. The price is that freed memory stays with the process (glibc
still returns a free top of the heap beyond 2 GiB).

`HYPARFLOW_MALLOC_TUNING=0` leaves glibc's defaults alone even when tuning is asked for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 * 2**20  # glibc's own upper bound for its adaptive threshold
TRIM_THRESHOLD = 2**31 - 1  # keep freed heap memory for the next step

_applied: bool | None = None


def keep_temporaries_in_heap() -> bool:
    """Keep large blocks in glibc's heap in this process, once; True if now in effect.

    Does nothing (False) off glibc (macOS, musl) or with `HYPARFLOW_MALLOC_TUNING=0`.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("HYPARFLOW_MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success.
    _applied = all(
        mallopt(parameter, value) == 1
        for parameter, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),  # kept for blocks glibc must still map
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_MMAP_MAX, 0),
        )
    )
    return _applied
