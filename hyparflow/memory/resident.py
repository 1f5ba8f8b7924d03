"""This process's resident memory: now, its peak, and the peak growth over a block of code."""

from __future__ import annotations

import os

_MIB = 2**20


def resident_bytes() -> int:
    """Bytes of this process's memory resident in RAM now (Linux `/proc/self/statm`)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    """The most resident bytes this process has held since start or `reset_peak()` (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmHWM line (not Linux?)")


def reset_peak() -> bool:
    """Restart the peak at the current resident size (Linux >= 4.0: `5` into clear_refs);
    False where the kernel refuses, so the peak still counts from process start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakGrowth:
    """Context manager measuring how far resident memory peaked above where the block began.

    For example:
        with PeakGrowth() as growth:
            hf.fit(model, x, y, epochs=1)
        print(f"{growth.mib:.0f} MiB")
    """

    def __enter__(self) -> PeakGrowth:
        self.exact = reset_peak()
        self.start = resident_bytes()
        self.bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = max(0, peak_bytes() - self.start)

    @property
    def mib(self) -> float:
        return self.bytes / _MIB
