"""An exception no code catches on one rank ends the whole MPI job, instead of hanging it.

Once MPI has started, Python's exit calls `MPI_Finalize`, which waits for every rank: a rank
that dies of an uncaught exception (a missing file on one node) then waits forever for peers
that wait, in their next collective, for it. `install` chains a `sys.excepthook` that, after
Python's usual traceback, calls `MPI_Abort` when MPI runs on more than one rank. Errors that
hyparflow raised identically on every rank (`comm.agree`) exit normally: every rank is exiting.
Before MPI has started, a rank's non-zero exit already makes mpirun end the job.
`import hyparflow` installs it under an MPI launcher; `HYPARFLOW_ABORT_ON_UNCAUGHT=0` opts out.

Such an agreed error is printed once, by rank 0, with the frames of the user's code only (what
they called, not hyparflow's internals); the other ranks exit with the same status quietly.
Every rank printing its whole traceback interleaved line by line hid the one useful line.
`HYPARFLOW_TRACEBACK=full` prints every rank's whole traceback again.
"""

from __future__ import annotations

import os
import sys
import traceback

ENV_SWITCH = "HYPARFLOW_ABORT_ON_UNCAUGHT"
TRACEBACK_SWITCH = "HYPARFLOW_TRACEBACK"  # "full": every rank's whole traceback
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hyparflow/


def install() -> bool:
    """Chain the aborting hook before the current `sys.excepthook`, once; unless opted out."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    if getattr(sys.excepthook, "hyparflow_aborts", False):
        return True
    previous = sys.excepthook

    def hook(kind, error, trace):
        world = _world()
        if world is not None and _agreed(error) and os.environ.get(TRACEBACK_SWITCH) != "full":
            if world.Get_rank() == 0:
                sys.stderr.write(users_traceback(error))
                sys.stderr.flush()
            return
        previous(kind, error, trace)
        abort_if_peers_would_wait(error)

    hook.hyparflow_aborts = True
    sys.excepthook = hook
    return True


def users_traceback(error: BaseException) -> str:
    """`error`'s traceback as Python prints it, without the frames of hyparflow's own code
    (each chained exception's too), under a line saying that every rank raised it."""
    shown = traceback.TracebackException.from_exception(error)
    for part in _chain(shown):
        part.stack = traceback.StackSummary.from_list(
            [frame for frame in part.stack if not frame.filename.startswith(_PACKAGE)]
        )
    return (
        "hyparflow: every rank raised this error; rank 0 prints it "
        f"({TRACEBACK_SWITCH}=full prints each rank's whole traceback):\n" + "".join(shown.format())
    )


def _chain(shown):
    while shown is not None:
        yield shown
        shown = shown.__cause__ or shown.__context__


def _world():
    """MPI's world communicator when MPI runs on several ranks, else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD if mpi.COMM_WORLD.Get_size() > 1 else None


def _agreed(error: BaseException) -> bool:
    from hyparflow.comm.agree import is_agreed

    return is_agreed(error)


def abort_if_peers_would_wait(error: BaseException) -> None:
    """Say which rank failed and end the job, if MPI runs on several ranks and `error` was not
    raised on all of them alike."""
    world = _world()
    if world is None or _agreed(error):
        return
    sys.stderr.write(
        f"hyparflow rank {world.Get_rank()}: uncaught {type(error).__name__}; ending the job "
        f"(MPI_Abort) so that the other {world.Get_size() - 1} rank(s) do not wait for this one "
        f"forever ({ENV_SWITCH}=0 leaves them waiting).\n"
    )
    sys.stderr.flush()
    world.Abort(1)
