"""What a scenario rank calls to hand its JSON result back to the launching test."""

from __future__ import annotations

import os
import sys
import traceback

from mpi4py import MPI

from tests.support.pool import write_json


def out_dir() -> str:
    """The folder the launching test collects results from (first command-line argument)."""
    return sys.argv[1]


def args() -> list[str]:
    """The scenario's own arguments, after the result folder."""
    return sys.argv[2:]


def report(result: dict) -> None:
    """Write this rank's result as `rank<N>.json` in the result folder."""
    rank = MPI.COMM_WORLD.Get_rank()
    write_json(os.path.join(out_dir(), f"rank{rank}.json"), result)


def run_or_abort(main) -> None:
    """Run a scenario's `main`; on any exception print it and abort the whole job, so that
    no rank is left blocked in MPI waiting for this one."""
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
