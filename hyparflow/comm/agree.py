"""Collective error agreement: a failure on any rank becomes the same error on every rank."""

from __future__ import annotations

import sys
import time
import traceback

import numpy as np


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

    For example:
        plan = agree(comm, partition, model, 2)   # a bad split errors on all ranks at once
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


# How long a rank that failed mid-step waits for the others to fail too before ending the job.
FAILURE_AGREEMENT_SECONDS = 30.0
_failure_comms: dict[int, object] = {}


def failure_comm(comm):
    """A duplicate of `comm` used only to agree on failures (collective the first time): ranks
    that did not fail never call it, so a failed rank's call can never meet another collective."""
    key = comm.py2f()
    if key not in _failure_comms:
        _failure_comms[key] = comm.Dup()
    return _failure_comms[key]


def same_ranks(clean, comm):
    """The ranks of `comm`, in its order, as a new communicator split out of `clean` (a
    duplicate of a communicator they all belong to that no failed step used); None where
    `comm` is None: this rank joins none. Collective over `clean`; the caller frees it."""
    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    if comm is None:
        clean.Split(color=MPI.UNDEFINED, key=0)
        return None
    first = comm.Get_group().Translate_ranks([0], clean.Get_group())[0]  # one color a group
    return clean.Split(color=first, key=comm.Get_rank())


def all_failed(comm, error: BaseException, timeout: float = FAILURE_AGREEMENT_SECONDS) -> bool:
    """After `error` in the middle of collective work: whether every rank of `comm` failed as
    well (then each may raise its error normally), waiting at most `timeout` seconds. A rank
    still blocked in MPI waiting for this one never answers: then False, and the job must end.
    `comm` is a `failure_comm`."""

    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    del error  # each rank raises its own error; only the fact of failing is shared
    flags = np.zeros(comm.Get_size(), np.int8)
    request = comm.Iallgather(np.ones(1, np.int8), [flags, MPI.INT8_T])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if request.Test():
            return bool(flags.all())
        time.sleep(0.01)
    return False


def abort_on_error(comm, error: BaseException, where: str) -> None:
    """Report `error` with this rank and end the whole job (mid-step, nothing can be agreed)."""
    rank = comm.Get_rank()
    sys.stderr.write(f"hyparflow rank {rank}: {where} failed, aborting the job:\n")
    traceback.print_exception(error, file=sys.stderr)
    sys.stderr.flush()
    comm.Abort(1)
