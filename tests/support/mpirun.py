"""Launch a scenario under a real `mpirun -np N` and collect every rank's JSON result."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tests.support import pool

# the checkout holding this file (tests/support/mpirun.py): its hyparflow is the one imported
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run as root, more ranks than cores, and one compute thread per rank so ranks don't fight.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": REPO,
}

# TensorFlow's pooled CPU allocator on any CPU: its default keeps no statistics and holds freed
# blocks in glibc's heap unless oneDNN is on (AVX-512 VNNI or newer); memory tests measure under
# this one (docs/testing.md)
POOLED_ALLOCATOR_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}

# "0" while pytest runs a test not marked `mpi` (tests/conftest.py): such a test may not launch
MPI_ALLOWED_ENV = "HF_TEST_MPI_ALLOWED"

# a folder where the launches of one pytest session share Keras references
# (tests/support/references.py; tests/conftest.py sets it)
REFERENCES_ENV = "HF_TEST_REFERENCES"


@dataclass(frozen=True)
class Launch:
    """One launch's measured wall time against its limit (tests/conftest.py reports them)."""

    test: str  # the pytest node that launched it (a module fixture: its first user)
    scenario: str
    np: int
    seconds: float
    timeout: float


# every launch of this pytest process, in order
LAUNCHES: list[Launch] = []


@dataclass
class MpiRun:
    """Outcome of one launch: exit code, per-rank results and per-rank stdout/stderr."""

    returncode: int
    results: list[dict | None]
    stdout: list[str]
    stderr: list[str]

    def describe(self, tail: int = 3000) -> str:
        parts = [f"mpirun exit code {self.returncode}"]
        for r, (out, err) in enumerate(zip(self.stdout, self.stderr, strict=True)):
            parts.append(f"--- rank {r} stdout (tail) ---\n{out[-tail:]}")
            parts.append(f"--- rank {r} stderr (tail) ---\n{err[-tail:]}")
        return "\n".join(parts)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _load_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def sharing() -> int:
    """How many pytest-xdist workers share this machine's cores (1 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def launch(
    scenario: str,
    np: int,
    *args: str,
    timeout: float = 300,
    env=None,
    prefix=(),
    collect=None,
    mpirun=("mpirun",),
    on_start=None,
    pooled=None,
) -> MpiRun:
    """Run `python -m tests.mpi.<scenario> OUT args...` on `np` ranks; never raises on failure.

    `prefix`: a command each rank runs the scenario under (e.g. tests/support/cgroup.py's
    memory cap). `collect(scratch)`, if given, is called before the scratch folder goes (its
    own files, e.g. per-rank reports the prefix wrote there: `env` values may name
    `{scratch}`). `mpirun`: the launcher and its first arguments (e.g. emulated nodes,
    tests/support/nodes.py). `on_start(process, scratch)`, if given, runs once the job has
    started and before waiting for it (to act on the running job, e.g. kill a node).
    A scenario of `pool.POOLED` launched with none of these runs in this process's pool of
    `np` ranks (tests/support/pool.py) instead of an `mpirun` of its own; `pooled` True or
    False says so for any scenario."""
    # limits are set for a launch alone on the machine; W workers' launches share its cores
    timeout *= sharing()
    if os.environ.get(MPI_ALLOWED_ENV) == "0":
        raise RuntimeError(
            f"this test launches {scenario!r} under mpirun: mark it `pytest.mark.mpi`, so that "
            "`make test-fast` leaves it out"
        )
    if pooled is None:
        pooled = scenario in pool.POOLED and not (env or prefix or collect or on_start)
        pooled = pooled and tuple(mpirun) == ("mpirun",)
    with tempfile.TemporaryDirectory(prefix=f"hf-{scenario}-") as tmp:
        out, logs = os.path.join(tmp, "results"), os.path.join(tmp, "logs")
        os.makedirs(out)
        env = {k: v.replace("{scratch}", tmp) for k, v in (env or {}).items()}
        started = time.monotonic()
        try:
            if pooled:
                job_pool = pool.pool(np, REPO, {**os.environ, **MPI_ENV})
                job = job_pool.submit(scenario, out, os.path.join(logs, "1"), args)
                returncode = job_pool.wait(job, timeout)
            else:
                rank_argv = [sys.executable, "-m", f"tests.mpi.{scenario}", out, *args]
                cmd = [*mpirun, *pool.mpirun_options(np, logs), *prefix, *rank_argv]
                returncode = _run_alone(
                    cmd, {**os.environ, **MPI_ENV, **env}, tmp, timeout, on_start
                )
        finally:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            LAUNCHES.append(Launch(test, scenario, np, time.monotonic() - started, timeout))
        run = _collected(np, out, logs, returncode)
        if collect is not None:
            collect(tmp)
        return run


def _run_alone(cmd: list, env: dict, scratch: str, timeout: float, on_start) -> int:
    """Run the job `cmd` in its own session; its exit code, or -9 once killed after `timeout`."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    try:
        if on_start is not None:
            on_start(proc, scratch)
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9
    except BaseException:  # on_start failed: leave no job behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _collected(np: int, out: str, logs: str, returncode: int) -> MpiRun:
    """Each rank's JSON result, stdout and stderr from a finished job's folders."""
    results, stdout, stderr = [], [], []
    for r in range(np):
        results.append(_load_json(os.path.join(out, f"rank{r}.json")))
        rank_dir = glob.glob(os.path.join(logs, "*", f"rank.{r}"))
        stdout.append(_read(os.path.join(rank_dir[0], "stdout")) if rank_dir else "")
        stderr.append(_read(os.path.join(rank_dir[0], "stderr")) if rank_dir else "")
    return MpiRun(returncode, results, stdout, stderr)


def run_scenario(
    scenario: str,
    np: int,
    *args: str,
    timeout: float = 300,
    env=None,
    mpirun=("mpirun",),
    pooled=None,
) -> list:
    """Launch and require success: every rank exits 0 and reports; else fail with all tails."""
    run = launch(scenario, np, *args, timeout=timeout, env=env, mpirun=mpirun, pooled=pooled)
    if run.returncode != 0 or any(r is None for r in run.results):
        raise AssertionError(f"scenario {scenario} failed on {np} ranks\n{run.describe()}")
    return run.results
