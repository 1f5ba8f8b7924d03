"""How much CPU other people's processes took while ours ran (the machine is shared).

Busy time of the whole machine comes from /proc/stat; ours is this process and every live
descendant (utime + stime + cutime + cstime of each: a reaped child's time moves into its
parent's cutime, so nothing is counted twice). The rest is foreign, in cores.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of all cores since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / TICKS, sum(fields) / TICKS


def _stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, utime + stime + cutime + cstime in seconds) for every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # the name may contain spaces
        ppid = int(fields[1])
        table[int(entry.name)] = (ppid, sum(int(v) for v in fields[11:15]) / TICKS)
    return table


def our_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds of `root` (default: this process) and its live descendants, reaped ones
    included through their parents."""
    root = os.getpid() if root is None else root
    table = _stats()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            total += table[pid][1]
        stack.extend(children.get(pid, ()))
    return total


class ForeignLoad:
    """Context manager sampling, every `interval` s, the cores other processes kept busy.

    Example:
        with ForeignLoad() as load:
            run_benchmark()
        load.mean, load.peak   # cores, averaged over the run / over the worst interval
    """

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()

    def _sample(self):
        busy, total = machine_busy_seconds()
        return busy, total, our_cpu_seconds()

    def __enter__(self):
        self._first = self._last = self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            now = self._sample()
            self.samples.append(_foreign_cores(self._last, now))
            self._last = now

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.mean = _foreign_cores(self._first, self._sample())
        self.peak = max(self.samples, default=self.mean)
        return False


def _foreign_cores(before, after) -> float:
    busy = after[0] - before[0]
    wall = (after[1] - before[1]) / CORES  # /proc/stat's total counts every core
    ours = after[2] - before[2]
    return max(0.0, (busy - ours) / wall) if wall > 0 else 0.0
