"""The MPI world as hyparflow sees it: rank and size, usable without a launcher.

Without a launcher, `rank()` and `size()` answer 0 and 1 without starting MPI: a process that
has started MPI on its own (a singleton) carries Open MPI's variables into every child, and an
`mpirun` started from it (a notebook's `!mpirun` after `hf.fit`) then fails silently.
"""

from __future__ import annotations

import os
import sys

# Set by the launchers hyparflow supports: Open MPI's mpirun, PMIx (srun --mpi=pmix, prterun),
# PMI-1/2 (MPICH's hydra, srun --mpi=pmi2), MVAPICH.
LAUNCHER_VARIABLES = (
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "MV2_COMM_WORLD_SIZE",
    "MPI_LOCALNRANKS",
)


def launched() -> bool:
    """Whether an MPI launcher started this process (or MPI is already running in it)."""
    if any(name in os.environ for name in LAUNCHER_VARIABLES):
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def world():
    """Return `MPI.COMM_WORLD`, starting MPI if needed (a singleton without a launcher)."""
    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    return MPI.COMM_WORLD


_LOOPS: list = []  # hyparflow's duplicate of the world, while no failed loop has left it


def loops_comm():
    """The communicator hyparflow's collective loops (hf.fit, evaluate, predict) run on: a
    duplicate of the world, made at the first call (collective), so that what a loop leaves
    half-done when a rank fails (a nonblocking barrier other ranks entered, comm/failure.py)
    never meets a collective on the world, the user's or the next loop's. After such a failure
    `retire_loops_comm` drops it, and the next call duplicates the world anew."""
    if not _LOOPS:
        _LOOPS.append(world().Dup())
    return _LOOPS[0]


def retire_loops_comm() -> None:
    """Forget the loops' communicator after a loop failed on some ranks mid-collective. It is
    not freed: requests the failure left on it stay pending forever."""
    _LOOPS.clear()


def rank() -> int:
    """This process's rank in the MPI world (0 when run without a launcher).

    For example:
        if hf.rank() == 0: print("only once")
    """
    return world().Get_rank() if launched() else 0


def size() -> int:
    """Number of ranks in the MPI world (1 when run without a launcher).

    For example:
        print(f"training on {hf.size()} ranks")
    """
    return world().Get_size() if launched() else 1
