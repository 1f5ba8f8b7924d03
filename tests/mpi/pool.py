"""Ranks that run scenarios one after another in one `mpirun` (tests/support/pool.py starts them).

A job is what `python -m tests.mpi.<scenario> OUT args...` runs, run here in the same process
as the jobs before it, as a user's script that calls hf.fit many times: TensorFlow, Keras and
MPI start once per pool instead of once per launch. Jobs arrive as files in the spool folder
(the first argument), `job<N>.json`; every rank reads job N itself, sleeping between looks so
that an idle pool leaves the cores to other tests, and leaves when the harness (the second
argument, its pid) has gone. It runs the job with its stdout and stderr in the job's log
folder and writes `done<N>.rank<R>.json`. A job that raises prints its traceback and aborts the
pool, as the scenario alone would end its job; the harness starts a new pool for the next one.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import time
import traceback

from mpi4py import MPI

from tests.support.pool import write_json

POLL_SECONDS = 0.02


def _read_job(spool: str, number: int, harness: int) -> dict:
    """Job `number` once it is on file; a stop order if the harness (pid) has gone."""
    path = os.path.join(spool, f"job{number}.json")
    while not os.path.exists(path):
        if not _alive(harness):
            return {"stop": True}
        time.sleep(POLL_SECONDS)
    with open(path) as f:
        return json.load(f)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _Redirected:
    """This process's stdout and stderr (file descriptors and Python's streams) go to `folder`."""

    def __init__(self, folder: str):
        os.makedirs(folder, exist_ok=True)
        self.folder = folder

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(os.path.join(self.folder, name), os.O_WRONLY | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)


def _run(job: dict) -> int:
    """Run the job's scenario as its own `__main__`; its exit code."""
    sys.argv = [f"tests.mpi.{job['scenario']}", job["out"], *job["args"]]
    try:
        runpy.run_module(f"tests.mpi.{job['scenario']}", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0


def _reset() -> None:
    """Leave Keras as a fresh process has it: layer names count from zero again."""
    import keras

    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()
    gc.collect()


def main() -> None:
    spool, harness = sys.argv[1], int(sys.argv[2])
    rank = MPI.COMM_WORLD.Get_rank()
    number = 0
    while True:
        job = _read_job(spool, number, harness)
        if job.get("stop"):
            return
        with _Redirected(os.path.join(job["logs"], f"rank.{rank}")):
            try:
                code = _run(job)
            except BaseException:
                traceback.print_exc()
                code = 1
        write_json(os.path.join(spool, f"done{number}.rank{rank}.json"), {"returncode": code})
        if code != 0:  # as the scenario alone: a failed rank ends the job, no peer left waiting
            MPI.COMM_WORLD.Abort(code)
        _reset()
        number += 1


if __name__ == "__main__":
    main()
