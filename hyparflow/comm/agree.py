"""Collective error agreement: a failure on any rank becomes the same error on every rank."""

from __future__ import annotations

import sys
import traceback


class RemoteRankError(RuntimeError):
    """Raised on ranks whose own work succeeded when another rank failed."""


def AgreedError(error: Exception) -> Exception:  # noqa: N802 - reads like the exception it marks
    """Mark `error` as raised identically on every rank at the same point (no abort needed)."""
    error.agreed = True
    return error


def is_agreed(error: BaseException) -> bool:
    return getattr(error, "agreed", False) or isinstance(error, RemoteRankError)


def agree(comm, work, *args, **kwargs):
    """Run `work(*args, **kwargs)` on every rank of `comm`; if it raised anywhere, raise everywhere.

    The rank that failed re-raises its own exception (same type and message); the others raise
    `RemoteRankError` naming the failed rank and its message. Nobody is left blocked in MPI.

    Example:
        >>> plan = agree(comm, partition, model, 2)   # a bad split errors on all ranks at once
    """
    try:
        result, error = work(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - every failure must be agreed on
        result, error = None, exc
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages = comm.allgather(message)
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return result
    if error is not None:
        raise AgreedError(error)
    rank, first = failed[0]
    raise RemoteRankError(f"rank {rank} failed: {first}")


def abort_on_error(comm, error: BaseException, where: str) -> None:
    """Report `error` with this rank and end the whole job (mid-step, nothing can be agreed)."""
    rank = comm.Get_rank()
    sys.stderr.write(f"hyparflow rank {rank}: {where} failed, aborting the job:\n")
    traceback.print_exception(error, file=sys.stderr)
    sys.stderr.flush()
    comm.Abort(1)
