"""Crash-safe file writes: temporary name, fsync, rename, fsync of the folder."""

from __future__ import annotations

import hashlib
import os


def fsync_dir(path: str) -> None:
    """Make a rename or creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, write) -> None:
    """Create `path` through `write(file)` so that a crash leaves either nothing or all of it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def sha256(path: str) -> str:
    """Hex digest of a file's bytes (detects a corrupted or truncated checkpoint file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
