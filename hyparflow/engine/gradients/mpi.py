"""mpi4py's reduction operations, looked up when first used."""

from __future__ import annotations


def mpi_op(name: str):
    """`MPI.<name>` (e.g. "LOR", "LAND", "IN_PLACE")."""
    # mpi4py's import starts MPI: deferred so that importing the engine never starts it.
    from mpi4py import MPI

    return getattr(MPI, name)
