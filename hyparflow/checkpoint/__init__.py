"""Distributed checkpoints: atomic per-stage saves, exact resume, reshape, export to .keras."""

from hyparflow.checkpoint.callback_state import check_resumable
from hyparflow.checkpoint.export import export
from hyparflow.checkpoint.stage import StageState
from hyparflow.checkpoint.store import find, read_checked, restore, save

__all__ = ["StageState", "check_resumable", "export", "find", "read_checked", "restore", "save"]
