"""Pools of MPI ranks that run several scenarios in one `mpirun` (tests/mpi/pool.py).

Each launch of a scenario used to start `mpirun` and import TensorFlow on every rank (about 4 s
of one core per rank) before its first case. The scenarios in `POOLED` train and compare
models and leave nothing behind in the process, so one pool per rank count runs them one after
another, as one script calling hf.fit many times. A scenario that tests the process itself
(memory, affinity, failures, killed ranks, emulated nodes, its own environment) keeps its own
launch. A pool whose job failed or ran out of time is gone; the next job starts a new one.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

POOLED = frozenset(
    {
        "equivalence",
        "real_models",
        "data_inputs",
        "zero",
        "hdf5_inputs",
        "callbacks_checks",
        "deferred_checks",
        "auto_fit",
        "hub_zoo",
    }
)
POLL_SECONDS = 0.02
STOP_SECONDS = 30


def mpirun_options(np: int, logs: str) -> list[str]:
    """mpirun's options for `np` test ranks: oversubscribed and unbound (the machine's cores are
    shared), each rank's output in `logs`."""
    return ["-np", str(np), "--oversubscribe", "--bind-to", "none", "--output-filename", logs]


class Pool:
    """`np` ranks of `tests.mpi.pool` waiting for jobs in a spool folder."""

    def __init__(self, np: int, cwd: str, env: dict):
        self.np = np
        self.spool = tempfile.mkdtemp(prefix=f"hf-pool{np}-")
        self.jobs = 0
        logs = os.path.join(self.spool, "logs")
        rank_argv = [sys.executable, "-m", "tests.mpi.pool", self.spool, str(os.getpid())]
        cmd = ["mpirun", *mpirun_options(np, logs), *rank_argv]
        self.process = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def submit(self, scenario: str, out: str, logs: str, args) -> int:
        """Hand the ranks a job; its number."""
        number = self.jobs
        job = {"scenario": scenario, "out": out, "logs": logs, "args": list(args)}
        write_json(os.path.join(self.spool, f"job{number}.json"), job)
        self.jobs += 1
        return number

    def wait(self, number: int, timeout: float) -> int:
        """The job's exit code once every rank has finished it: 0, a rank's code, the pool's
        own if it ended (a rank aborted), or -9 after `timeout` (the pool is killed)."""
        deadline = time.monotonic() + timeout
        done = [os.path.join(self.spool, f"done{number}.rank{r}.json") for r in range(self.np)]
        try:
            while not all(os.path.exists(path) for path in done):
                if not self.alive():
                    code = self.process.returncode or 1
                    self.kill()  # gone already: only its spool folder is left to remove
                    return code
                if time.monotonic() > deadline:
                    self.kill()
                    return -9
                time.sleep(POLL_SECONDS)
        except BaseException:  # e.g. the test's own timeout: no job may outlive its test
            self.kill()
            raise
        failed = [code for code in map(_read_code, done) if code != 0]
        if failed:  # its ranks abort: this pool takes no more jobs
            self.kill()
        return failed[0] if failed else 0

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self.spool, ignore_errors=True)

    def stop(self) -> None:
        """Let the ranks leave their loop and MPI finish; kill them if they do not."""
        if self.alive():
            write_json(os.path.join(self.spool, f"job{self.jobs}.json"), {"stop": True})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=STOP_SECONDS)
        self.kill()


_pools: dict[int, Pool] = {}


def pool(np: int, cwd: str, env: dict) -> Pool:
    """This process's running pool of `np` ranks, started if there is none."""
    current = _pools.get(np)
    if current is None or not current.alive():
        current = _pools[np] = Pool(np, cwd, env)
    return current


def running(np: int) -> Pool | None:
    """This process's pool of `np` ranks if it is running, else None."""
    current = _pools.get(np)
    return current if current is not None and current.alive() else None


@atexit.register
def stop_all() -> None:
    """Stop this process's pools (at the end of the test session)."""
    for each in _pools.values():
        each.stop()
    _pools.clear()


def write_json(path: str, content: dict) -> None:
    """Write `content` to `path` at once (a reader polling for the file never sees half)."""
    with open(path + ".tmp", "w") as f:
        json.dump(content, f)
    os.replace(path + ".tmp", path)


def _read_code(path: str) -> int:
    with open(path) as f:
        return int(json.load(f)["returncode"])
