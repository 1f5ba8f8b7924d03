"""glibc tuning for ranks sharing a node: large temporaries stay in the heap, opt-out works."""

import sys

import pytest

from tests.support.probe import python_output

PROBE = """
import ctypes, ctypes.util, sys
from hyparflow.launch.malloc import keep_temporaries_in_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
applied = keep_temporaries_in_heap()
before = libc.mallinfo2().hblks
# An 8 MiB temporary, as TF's allocator would ask, and one above glibc's largest threshold.
blocks = [libc.malloc(8 * 2**20), libc.malloc(64 * 2**20)]
assert all(blocks)
mapped = libc.mallinfo2().hblks - before
for block in blocks:
    libc.free(block)
print(applied, mapped)
"""


def _probe(**env):
    applied, mapped = python_output(PROBE, **env).split()
    return applied == "True", int(mapped)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_large_blocks_come_from_the_heap_once_tuned_and_can_be_left_alone():
    assert _probe() == (True, 0)  # no separate mapping for either block
    assert _probe(HYPARFLOW_MALLOC_TUNING="0") == (False, 2)  # glibc's default: mmap both
