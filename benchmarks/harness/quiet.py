"""Wait, for a bounded time, until the machine is quiet before measuring; say how quiet it was."""

from __future__ import annotations

import os
import time


def busy_fraction(seconds: float = 2.0) -> float:
    """Fraction of all cores busy over the next `seconds`, every process counted."""

    def sample():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields) - fields[3] - fields[4], sum(fields)  # minus idle and iowait

    busy0, total0 = sample()
    time.sleep(seconds)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(1, total1 - total0)


def wait_for_quiet(max_load=1.0, max_busy=0.15, patience=600.0, log=print) -> dict:
    """Block until the 1-minute load is under `max_load` and under `max_busy` of the cores are
    busy, or `patience` seconds passed; returns the load it measured at."""
    start = time.monotonic()
    while os.getloadavg()[0] >= max_load or busy_fraction() >= max_busy:
        if time.monotonic() - start > patience:
            log(f"machine still busy after {patience:.0f} s; measuring anyway")
            break
        time.sleep(10)
    return {"load1": os.getloadavg()[0], "waited_s": time.monotonic() - start}
