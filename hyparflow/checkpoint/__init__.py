"""Distributed checkpoints: atomic per-stage saves, exact resume, reshape, export to .keras."""

from hyparflow.checkpoint.export import export
from hyparflow.checkpoint.store import find, read_checked, restore, save

__all__ = ["export", "find", "read_checked", "restore", "save"]
