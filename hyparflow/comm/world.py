"""The MPI world as hyparflow sees it: rank and size, usable without a launcher (singleton)."""

from __future__ import annotations


def world():
    """Return `MPI.COMM_WORLD`; importing mpi4py here initializes MPI (singleton if no mpirun)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def rank() -> int:
    """This process's rank in the MPI world (0 when run without a launcher).

    Example:
        >>> if hf.rank() == 0: print("only once")
    """
    return world().Get_rank()


def size() -> int:
    """Number of ranks in the MPI world (1 when run without a launcher).

    Example:
        >>> print(f"training on {hf.size()} ranks")
    """
    return world().Get_size()
