"""This process's resident memory: now, and its peak (Linux /proc); variables' bytes."""

from __future__ import annotations


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    """Resident set size now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Highest resident set size since the process started."""
    return _status_kib("VmHWM") * 1024


def variable_bytes(variables) -> int:
    """Bytes of the values of `variables` (Keras or TensorFlow)."""
    import numpy as np

    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables))
