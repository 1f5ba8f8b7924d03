"""Run a benchmark worker in a fresh process: alone or under `mpirun`, in either venv.

Every rank runs with one TensorFlow compute thread (TF_NUM_INTRAOP_THREADS=1), so that two
ranks on a 2-core machine do not fight over cores; a single-process baseline that may use the
whole machine says so by passing `threads=`. Workers write their JSON result to
`<result_dir>/rank_<r>.json`; the launcher returns every rank's result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAIN_PYTHON = REPO / ".venv" / "bin" / "python"
COMPAT_VENV = Path(os.environ.get("HYPARFLOW_COMPAT_VENV", REPO / ".venv-compat"))
COMPAT_PYTHON = COMPAT_VENV / "bin" / "python"
INTRAOP_THREADS = 1  # per rank; stated in results.md

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONPATH": str(REPO),
    "PYTHONUNBUFFERED": "1",
}


def thread_env(threads: int = INTRAOP_THREADS) -> dict:
    """TensorFlow's and OpenMP's thread counts for one process."""
    return {
        "TF_NUM_INTRAOP_THREADS": str(threads),
        "TF_NUM_INTEROP_THREADS": "1",
        "OMP_NUM_THREADS": str(threads),
    }


def python_for(venv: str) -> str:
    """The interpreter of "main" (.venv) or "compat" (.venv-compat, with Horovod)."""
    path = {"main": MAIN_PYTHON, "compat": COMPAT_PYTHON}[venv]
    return str(path) if path.exists() else sys.executable


def has_horovod() -> bool:
    """Whether the compatibility venv (TF 2.17 + Horovod, `scripts/test_compat.sh`) exists."""
    return COMPAT_PYTHON.exists()


def mpirun_command(np: int, argv: list[str]) -> list[str]:
    return ["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none", *argv]


def run_worker(
    script: str,
    args: list,
    *,
    np: int = 1,
    venv: str = "main",
    threads=None,
    timeout: float = 1800,
    env: dict | None = None,
) -> list:
    """Run `script --worker-out DIR args...` on `np` ranks (np=1: no mpirun); every rank's
    JSON result, in rank order. Raises with the tail of stderr when the run fails."""
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as folder:
        argv = [python_for(venv), str(script), "--worker-out", folder, *map(str, args)]
        command = argv if np == 1 else mpirun_command(np, argv)
        full_env = {**os.environ, **MPI_ENV, **thread_env(threads or INTRAOP_THREADS)}
        full_env.update(env or {})
        _communicate(command, full_env, timeout)
        results = []
        for rank in range(np):
            path = Path(folder) / f"rank_{rank}.json"
            results.append(json.loads(path.read_text()) if path.exists() else None)
        return results


def _communicate(command: list[str], env: dict, timeout: float) -> None:
    """Run `command` in a session of its own, so that a timeout kills the whole mpirun job;
    raises with the tail of its output when it fails or runs over."""
    pipe = subprocess.PIPE
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as error:
        os.killpg(process.pid, signal.SIGKILL)  # the whole mpirun job we started
        stdout, stderr = process.communicate()
        message = f"{' '.join(command)} ran over {timeout} s:\n{stderr[-3000:]}"
        raise RuntimeError(message) from error
    if process.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({process.returncode}):\n{stdout[-2000:]}\n"
            f"{stderr[-4000:]}"
        )


def write_result(folder: str, rank: int, result) -> None:
    """A worker's answer, read back by `run_worker`."""
    path = Path(folder) / f"rank_{rank}.json"
    path.write_text(json.dumps(result))
