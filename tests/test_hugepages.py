"""Huge pages under MPI's buffers: page arithmetic, and real collapses checked in /proc."""

import json
import os
import platform
import sys

import pytest

from hyparflow.comm.hugepages import THP_SETTING, covered_pages, thp_allowed
from tests.support.probe import python_output


def hugepages_expected() -> bool:
    """Whether promotion must be on here: Linux 6.1+ with THP not "never" and glibc."""
    if not sys.platform.startswith("linux") or not os.path.exists(THP_SETTING):
        return False
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    with open(THP_SETTING) as file:
        allowed = thp_allowed(file.read())
    return allowed and (major, minor) >= (6, 1) and platform.libc_ver()[0] == "glibc"


def test_covered_pages_round_outward():
    page = 2 * 2**20
    assert list(covered_pages(page, page)) == [page]
    assert list(covered_pages(page + 1, page)) == [page, 2 * page]
    assert list(covered_pages(0, 0)) == []
    assert len(covered_pages(123, 6 * 2**20)) == 4


PROBE = """
import json, numpy as np, tensorflow as tf
from hyparflow.comm import hugepages

def anon_huge_kib(address):
    # AnonHugePages of the mapping that holds `address` (/proc/self/smaps).
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0

from hyparflow.launch.malloc import keep_temporaries_in_heap

default = hugepages.promoter()  # off until asked for (hf.Strategy(tune_process=True))
assert not default.enabled and "not requested" in default.reason, default.reason
worker = hugepages.start_promoting(keep_temporaries_in_heap())
out = {"enabled": worker.enabled, "reason": worker.reason}
if worker.enabled:
    tensor = tf.random.normal((8 * 2**20 // 4,))  # 8 MiB from TF's allocator (glibc's heap)
    address = np.asarray(tensor).ctypes.data
    before = anon_huge_kib(address)
    out["first"] = hugepages.promote_tensor(tensor)
    out["gained_kib"] = anon_huge_kib(address) - before
    out["again"] = hugepages.promote_tensor(tensor)
    out["small"] = hugepages.promote_tensor(tf.ones((1000,)))
    buffer = hugepages.huge_zeros((5 * 2**20 // 4,), "float32")
    out["buffer"] = [buffer.ctypes.data % (2 * 2**20), float(abs(buffer).max())]
print(json.dumps(out))
"""


def _probe(**env):
    return json.loads(python_output(PROBE, **env).strip().splitlines()[-1])


def test_tensor_pages_are_collapsed_once_and_opt_out_works():
    out = _probe()
    assert out["enabled"] == hugepages_expected(), out["reason"]
    if out["enabled"]:
        assert out["first"] >= 4  # 8 MiB unaligned: 4 or 5 pages hold some of it
        assert out["gained_kib"] >= 8 * 1024  # the kernel now maps them as huge pages
        assert out["again"] == 0 and out["small"] == 0
        assert out["buffer"] == [0, 0.0]
    off = _probe(HYPARFLOW_HUGEPAGES="0")
    assert off == {"enabled": False, "reason": "HYPARFLOW_HUGEPAGES=0"}
    untuned = _probe(HYPARFLOW_MALLOC_TUNING="0")
    assert not untuned["enabled"]
    if hugepages_expected():
        assert "heap tuning" in untuned["reason"]


@pytest.mark.skipif(not hugepages_expected(), reason="needs Linux 6.1+ with THP")
def test_kernel_probe_finds_collapse():
    from hyparflow.comm.hugepages import HugePagePromoter

    assert HugePagePromoter().start(heap_kept=True)
    assert not HugePagePromoter().start(heap_kept=False)


def test_buffer_shortcut_stays_bounded_and_pages_are_still_remembered():
    from hyparflow.comm import hugepages

    worker = hugepages.HugePagePromoter()
    calls = []
    worker._madvise = lambda page, size, advice: calls.append(page) or 0
    worker.enabled = True  # a stand-in madvise: this checks the bookkeeping, not the kernel
    size = hugepages.MIN_BYTES
    for i in range(hugepages.SEEN_BUFFERS + 10):
        worker.promote(i * 64, size)  # distinct buffers over the same few pages
    assert len(worker._seen_buffers) <= hugepages.SEEN_BUFFERS
    assert len(calls) == len(set(calls)) == worker.collapsed  # each page collapsed once
