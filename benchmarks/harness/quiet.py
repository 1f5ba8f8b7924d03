"""Wait for a quiet machine before measuring, and say how quiet it was.

The machine is shared: a run is only taken once the 1-minute load average is under a bound,
under a small share of the cores is busy right now (/proc/stat over 2 s), and no other
engineer's benchmark (the simulator validation) is running.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Command lines of others' measurement jobs that need the machine to themselves.
OTHER_BENCHMARKS = ("simulator_validation.py", "paper_projection.py")


def busy_fraction(seconds: float = 2.0) -> float:
    """Fraction of all cores busy over the next `seconds`, every process counted."""

    def sample():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    busy0, total0 = sample()
    time.sleep(seconds)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(1, total1 - total0)


def others_running(ours: int | None = None) -> list[str]:
    """Command lines of other benchmark processes (not this process or its parent chain)."""
    mine = {os.getpid(), os.getppid(), ours or 0}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(name in cmdline for name in OTHER_BENCHMARKS):
            found.append(cmdline.strip())
    return found


def wait_for_quiet(
    max_load: float | None = 1.0, max_busy: float = 0.15, patience: float = 7200, log=print
) -> dict:
    """Block until the machine is quiet (or `patience` s passed); returns what it saw.
    `max_load=None` skips the load average (which lags a minute behind our own last run)."""
    start = time.monotonic()
    last_log = -60.0
    while True:
        others = others_running()
        load = os.getloadavg()[0]
        calm = not others and (max_load is None or load < max_load)
        busy = busy_fraction() if calm else None
        if calm and busy < max_busy:
            break
        if time.monotonic() - start > patience:
            log(f"machine still busy after {patience:.0f} s (load {load:.2f}); measuring anyway")
            break
        if time.monotonic() - last_log >= 60:  # say so once a minute
            reason = "another benchmark is running" if others else f"load {load:.2f}"
            log(f"waiting for a quiet machine: {reason}", flush=True)
            last_log = time.monotonic()
        time.sleep(10)
    return {"load1": os.getloadavg()[0], "busy": busy, "waited_s": time.monotonic() - start}
