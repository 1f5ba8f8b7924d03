"""Rank 0 reports, rank 1 raises: checks that the harness surfaces a rank's failure."""

from mpi4py import MPI

from tests.support.report import report

if MPI.COMM_WORLD.Get_rank() == 1:
    raise RuntimeError("deliberate failure on rank 1")
report({"rank": 0})
