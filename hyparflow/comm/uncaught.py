"""An exception no code catches on one rank ends the whole MPI job, instead of hanging it.

Once MPI has started, Python's exit calls `MPI_Finalize`, which waits for every rank: a rank
that dies of an uncaught exception (a missing file on one node) then waits forever for peers
that wait, in their next collective, for it. `install` chains a `sys.excepthook` that, after
Python's usual traceback, calls `MPI_Abort` when MPI runs on more than one rank. Errors that
hyparflow raised identically on every rank (`comm.agree`) exit normally: every rank is exiting.
Before MPI has started, a rank's non-zero exit already makes mpirun end the job.
`import hyparflow` installs it under an MPI launcher; `HYPARFLOW_ABORT_ON_UNCAUGHT=0` opts out.
"""

from __future__ import annotations

import os
import sys

ENV_SWITCH = "HYPARFLOW_ABORT_ON_UNCAUGHT"


def install() -> bool:
    """Chain the aborting hook before the current `sys.excepthook`, once; unless opted out."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    if getattr(sys.excepthook, "hyparflow_aborts", False):
        return True
    previous = sys.excepthook

    def hook(kind, error, trace):
        previous(kind, error, trace)
        abort_if_peers_would_wait(error)

    hook.hyparflow_aborts = True
    sys.excepthook = hook
    return True


def abort_if_peers_would_wait(error: BaseException) -> None:
    """Say which rank failed and end the job, if MPI runs on several ranks and `error` was not
    raised on all of them alike."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    from hyparflow.comm.agree import is_agreed

    world = mpi.COMM_WORLD
    if world.Get_size() == 1 or is_agreed(error):
        return
    sys.stderr.write(
        f"hyparflow rank {world.Get_rank()}: uncaught {type(error).__name__}; ending the job "
        f"(MPI_Abort) so that the other {world.Get_size() - 1} rank(s) do not wait for this one "
        f"forever ({ENV_SWITCH}=0 leaves them waiting).\n"
    )
    sys.stderr.flush()
    world.Abort(1)
