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
