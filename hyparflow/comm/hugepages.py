"""Back the host memory that MPI copies between ranks with transparent huge pages (opt-in).

Open MPI moves a large message between ranks of one node with one `process_vm_readv` (CMA) by
the receiver, which walks the sender's pages, so 2 MiB pages cross faster than 4 KiB ones
(docs/comm.md). numpy backs its large arrays with huge pages; TensorFlow's tensors come from
glibc's `malloc` in 4 KiB pages (glibc reads `glibc.malloc.hugetlb` only from the environment
of a starting process).

`promote` asks the kernel to rebuild the 2 MiB pages under a buffer as huge pages
(`madvise(MADV_COLLAPSE)`, Linux 6.1+), once per page. That pays off only because the pages
stay: with glibc's heap kept (`hyparflow.launch.malloc`), a training step reuses the same heap
addresses as the last, so a pipeline collapses its pages in its first steps and never again;
without it glibc unmaps large blocks when freed and a collapse would cost a copy per step.

Promotion changes how this process's memory is mapped, so it is off until asked for:
`hf.Strategy(tune_process=True)` starts it (`start_promoting`). `HYPARFLOW_HUGEPAGES=0` keeps
it off even then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
import sys
import threading

import numpy as np

from hyparflow.comm.dlpack import ALIGNMENT, aligned_empty

HUGE_PAGE = 2 * 2**20  # x86-64 and aarch64 (4 KiB base pages) PMD size
MIN_BYTES = 4 * 2**20  # numpy's own threshold for huge pages; smaller messages gain little
MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1
SEEN_BUFFERS = 4096  # buffers remembered for the one-lookup shortcut (bounds its memory)
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def covered_pages(address: int, nbytes: int, page: int = HUGE_PAGE) -> range:
    """Start addresses of the `page`-aligned pages that hold any byte of `[address, +nbytes)`.

    Example:
        >>> [hex(p) for p in covered_pages(0x1ff000, 0x202000)]
        ['0x0', '0x200000', '0x400000']
    """
    if nbytes <= 0:
        return range(0)
    first = address // page * page
    end = -(-(address + nbytes) // page) * page
    return range(first, end, page)


def thp_allowed(setting: str) -> bool:
    """Whether the kernel's THP mode (the sysfs line, e.g. `always [madvise] never`) allows them.

    Example:
        >>> thp_allowed("always [madvise] never"), thp_allowed("always madvise [never]")
        (True, False)
    """
    return "[never]" not in setting


def _collapse_works(madvise) -> bool:
    """Whether this kernel collapses a huge page of a private anonymous mapping of our own."""

    with mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as region:
        view = (ctypes.c_char * len(region)).from_buffer(region)
        try:
            address = ctypes.addressof(view)
            page = -(-address // HUGE_PAGE) * HUGE_PAGE  # the whole huge page inside it
            view[page - address] = b"\1"  # the kernel collapses only pages with something in
            return madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0
        finally:
            del view  # the mapping cannot close while exported


class HugePagePromoter:
    """Collapse the heap pages under sent buffers into huge pages, each page at most once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seen_buffers: set[tuple[int, int]] = set()
        self._pages: set[int] = set()  # pages already collapsed, or found not collapsible
        self._madvise = None
        self.enabled = False
        self.collapsed = 0  # pages this process collapsed
        self.failed = 0  # pages the kernel would not collapse (not anonymous, no free huge page)
        self.reason = "off: not requested (hf.Strategy(tune_process=True))"

    def start(self, heap_kept: bool) -> bool:
        """Find `madvise` and check that THP is on and glibc keeps its heap (`heap_kept`);
        True if promoting."""
        self.enabled = False
        if os.environ.get("HYPARFLOW_HUGEPAGES", "1") == "0":
            self.reason = "HYPARFLOW_HUGEPAGES=0"
            return False
        if not sys.platform.startswith("linux"):
            self.reason = f"not Linux ({sys.platform})"
            return False
        try:
            with open(THP_SETTING) as file:
                setting = file.read()
        except OSError:
            self.reason = f"no {THP_SETTING}"
            return False
        if not thp_allowed(setting):
            self.reason = "transparent huge pages are off (never)"
            return False
        if not heap_kept:
            self.reason = "glibc heap tuning not in effect (hyparflow.launch.malloc)"
            return False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            madvise = libc.madvise
        except (OSError, AttributeError, TypeError):
            self.reason = "no madvise in the C library"
            return False
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        if not _collapse_works(madvise):
            self.reason = "the kernel cannot collapse pages (MADV_COLLAPSE needs Linux 6.1)"
            return False
        self._madvise, self.enabled, self.reason = madvise, True, "on"
        return True

    def promote(self, address: int, nbytes: int) -> int:
        """Collapse the pages under `[address, +nbytes)` not handled before; returns how many.

        Pages at the ends are collapsed whole: the rest of such a page is other heap memory of
        this process, whose contents a collapse keeps. Buffers under MIN_BYTES are left alone.
        """
        if not self.enabled or nbytes < MIN_BYTES:
            return 0
        key = (address, nbytes)
        if key in self._seen_buffers:
            return 0
        done = 0
        with self._lock:
            if len(self._seen_buffers) >= SEEN_BUFFERS:  # only a shortcut: `_pages` remembers
                self._seen_buffers.clear()
            self._seen_buffers.add(key)
            for page in covered_pages(address, nbytes):
                if page in self._pages:
                    continue
                self._pages.add(page)
                if self._madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
                    done += 1
                else:  # no huge page free, or the page is not all anonymous heap memory
                    self.failed += 1
            self.collapsed += done
        return done


_promoter: HugePagePromoter | None = None


def promoter() -> HugePagePromoter:
    """This process's promoter: off unless `start_promoting` turned it on."""
    global _promoter
    if _promoter is None:
        _promoter = HugePagePromoter()
    return _promoter


def start_promoting(heap_kept: bool) -> HugePagePromoter:
    """Opt this process in to promotion (once); `heap_kept` says glibc keeps its heap."""
    worker = promoter()
    if not worker.enabled:
        worker.start(heap_kept)
    return worker


def promote_tensor(tensor, nbytes: int | None = None) -> int:
    """Collapse the pages under a host tensor's or array's buffer (see `HugePagePromoter`).

    `nbytes`, when the caller knows it, saves asking the tensor.
    """
    worker = promoter()
    if not worker.enabled:
        return 0
    if nbytes is None:
        if isinstance(tensor, np.ndarray):
            nbytes = tensor.nbytes
        else:  # a TF tensor: sized before asking TF for its buffer
            nbytes = tensor.shape.num_elements() * tensor.dtype.size
    if nbytes < MIN_BYTES:
        return 0
    view = np.asarray(tensor)  # a CPU tensor's own memory, no copy
    return worker.promote(view.ctypes.data, view.nbytes)


def huge_zeros(shape, dtype):
    """A long-lived zeroed host buffer for MPI to copy into and out of.

    Large buffers (MIN_BYTES and up) start on a huge-page boundary and are promoted, so that
    every page of them is huge (an unaligned buffer's first and last pages share 2 MiB with
    other memory, which the kernel may refuse to collapse); smaller ones are 64-byte aligned.
    Zeroing first gives the kernel pages to collapse (it refuses pages never touched).
    """
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    large = nbytes >= MIN_BYTES and promoter().enabled
    buffer = aligned_empty(shape, dtype, HUGE_PAGE if large else ALIGNMENT)
    buffer[...] = 0
    if large:
        promote_tensor(buffer)
    return buffer
