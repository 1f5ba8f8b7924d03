"""Byte sizes as people write them ("16GiB", "1.5 GB", "4096"), for budgets and options (pure)."""

from __future__ import annotations

import re

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3,  "mb": 10**6,  "gb": 10**9,  "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def byte_size(text: str) -> int:
    """Bytes in `text`, e.g. "16GiB", "1.5 GB", "4096".

    >>> byte_size("16GiB"), byte_size("1.5 GB"), byte_size("4096")
    (17179869184, 1500000000, 4096)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in UNITS:
        raise ValueError(f"{text!r} is not a size: write e.g. 16GiB, 1.5GB or 4096")
    return int(float(match.group(1)) * UNITS[unit])
