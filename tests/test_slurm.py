"""hf.fit through a real single-node Slurm: `srun --mpi=pmix` and `sbatch` running mpirun.

The fixture starts munged, slurmctld and slurmd (tests/support/slurm_cluster.py) and stops
them after. Slurm must be installed (`apt-get install slurm-wlm munge`, as root): without it
these tests fail with that instruction rather than skip.
"""

import glob
import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from tests.support.mpirun import MPI_ENV, REPO
from tests.support.slurm_cluster import INSTALL_HINT, missing_tools, start_cluster

pytestmark = pytest.mark.mpi  # every test here starts MPI jobs

TOLERANCE = 1e-5
SBATCH = os.path.join(REPO, "examples", "slurm", "train.sbatch")
SLURM_FIT = [sys.executable, "-m", "tests.mpi.slurm_fit"]  # each rank's program, given a folder


@pytest.fixture(scope="module")
def slurm():
    missing = missing_tools()
    if missing:
        pytest.fail(f"Slurm is not installed (missing {', '.join(missing)}): {INSTALL_HINT}")
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests start slurmd and munged as root: run them as root")
    cluster = start_cluster(extra_env=MPI_ENV)
    try:
        yield cluster
    finally:
        cluster.stop()


def _run_job(slurm, command, out_dir, timeout=400):
    try:
        done = slurm.run(command, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        slurm.run(["scancel", "--full", "--user=root"], timeout=30)
        pytest.fail(f"{command[0]} did not finish in {timeout} s\n{slurm.logs()}")
    results = []
    for path in sorted(glob.glob(os.path.join(out_dir, "rank*.json"))):
        with open(path) as f:
            results.append(json.load(f))
    return done, results


def _check_training(results, describe):
    assert [r["rank"] for r in results] == [0, 1], describe()
    for r in results:
        assert r["size"] == 2, describe()
        for kind, difference in r["weights"].items():
            assert difference < TOLERANCE, f"rank {r['rank']} {kind}: {difference:.2e}"
    assert len({r["job_id"] for r in results}) == 1
    assert sorted(r["local_rank"] for r in results) == [0, 1]


def test_srun_pmix_runs_hf_fit_directly(slurm, tmp_path):
    srun = shlex.split("srun -n 2 -c 1 --mpi=pmix --time=10 --job-name=hf-srun")
    command = [*srun, *SLURM_FIT, str(tmp_path)]
    done, results = _run_job(slurm, command, tmp_path)

    def describe():
        output = f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        return f"srun exit {done.returncode}\n{output}\n{slurm.logs()}"

    assert done.returncode == 0, describe()
    _check_training(results, describe)
    for r in results:
        assert r["step_id"] == "0" and r["slurm_procid"] == str(r["rank"])
        assert r["job"].endswith("step 0: 1 node(s) localhost, 2 task(s), 1 CPU(s) per task")
        assert r["cpus_per_rank"] == 1


def test_sbatch_script_runs_mpirun_in_the_allocation(slurm, tmp_path):
    log = tmp_path / "job.out"
    allocation = "--nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 --time=10"
    sbatch = ["sbatch", "--wait", *shlex.split(allocation), f"--output={log}", SBATCH]
    command = [*sbatch, *SLURM_FIT, str(tmp_path)]
    done, results = _run_job(slurm, command, tmp_path)

    def describe():
        job_log = log.read_text() if log.exists() else "(no job output)"
        output = f"{done.stderr[-2000:]}\njob output:\n{job_log[-5000:]}"
        return f"sbatch exit {done.returncode}\n{output}\n{slurm.logs()}"

    assert done.returncode == 0, describe()
    _check_training(results, describe)
    for r in results:
        assert r["step_id"] is None, "mpirun's ranks run in the batch step"
        assert r["job"].endswith("batch: 1 node(s) localhost, 2 task(s), 1 CPU(s) per task")
        assert r["intra_op_threads"] == "1", "the script sizes TF's threads to --cpus-per-task"
    assert "hyparflow: job" in log.read_text()


def test_hyparflow_run_starts_the_demo_with_srun_in_the_allocation(slurm, tmp_path):
    """`hyparflow run -n 2 examples/demo.py` in a batch script picks `srun --mpi=pmix`."""
    log = tmp_path / "job.out"
    hyparflow = os.path.join(os.path.dirname(sys.executable), "hyparflow")  # console script
    script = shlex.join([hyparflow, "run", "-n", "2", os.path.join("examples", "demo.py")])
    command = [
        "sbatch",
        "--wait",
        "--ntasks=2",
        "--cpus-per-task=1",
        "--time=10",
        f"--output={log}",
        f"--wrap={script}",
    ]
    done, _ = _run_job(slurm, command, tmp_path)
    job_log = log.read_text() if log.exists() else "(no job output)"
    describe = f"sbatch exit {done.returncode}\n{done.stderr[-2000:]}\n{job_log[-5000:]}"
    assert done.returncode == 0, f"{describe}\n{slurm.logs()}"
    printed = [line for line in job_log.splitlines() if " --mpi=pmix " in line]
    assert len(printed) == 1, describe
    words = shlex.split(printed[0])
    command = words[words.index("srun") :]
    assert command[:7] == ["srun", "--mpi=pmix", "-n", "2", "-c", "1", "--cpu-bind=cores"]
    assert command[-2:] == [sys.executable, os.path.join("examples", "demo.py")]
    assert "mpirun" not in job_log.split("Trained")[0], describe
    assert "Trained 5 epochs on 2 ranks (strategy 'auto')" in job_log, describe


def test_a_fresh_cluster_ignores_one_left_running(slurm):
    """The fixture's cluster plays a stale one from an earlier run: a new one still works."""
    fresh = start_cluster(extra_env=MPI_ENV)
    try:
        assert (fresh.root, fresh.name) != (slurm.root, slurm.name)
        for cluster in (slurm, fresh):
            done = cluster.run(["srun", "-n", "1", "printenv", "SLURM_CLUSTER_NAME"], timeout=60)
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip() == cluster.name
    finally:
        fresh.stop()
    assert not os.path.exists(fresh.root)
    assert all(proc.poll() is not None for proc in fresh.daemons.values())


REQUEUE = os.path.join(REPO, "examples", "slurm", "requeue.sbatch")


def _state(slurm, job: str) -> str:
    """The job's state letters (R, PD, ...) as squeue shows them; empty once it is gone."""
    return slurm.run(["squeue", "-h", "-j", job, "-o", "%t"], timeout=30).stdout.strip()


def test_the_requeue_script_checkpoints_on_sigterm_and_its_next_run_resumes(slurm, tmp_path):
    """examples/slurm/requeue.sbatch: `scancel --signal=TERM --batch` (as --signal=B:TERM
    does before a time limit) reaches hyparflow run through the script's trap; the job saves
    its step, exits 75 and requeues itself, and its second run finishes with no step redone."""
    out, job, log = tmp_path / "out", tmp_path / "job", tmp_path / "job.out"
    out.mkdir()
    job.mkdir()
    scenario = ["python", "-m", "tests.mpi.elastic", str(out), "preempt", "auto", str(job)]
    allocation = "--nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 --time=10"
    path = f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"  # hyparflow, python
    exports = f"--export=ALL,PATH={path},HF_RANK_PIDS={tmp_path / 'pids'}"
    sbatch = ["sbatch", "--parsable", *shlex.split(allocation), exports, f"--output={log}"]
    submitted = slurm.run([*sbatch, REQUEUE, *scenario], cwd=REPO, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    number = submitted.stdout.strip().split(";")[0]
    steps = job / "steps.jsonl"

    def describe() -> str:
        job_log = log.read_text() if log.exists() else "(no job output)"
        return f"{job_log[-5000:]}\n{slurm.logs()}"

    def wait_for(done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                slurm.run(["scancel", number], timeout=30)
                pytest.fail(f"job {number} stalled\n{describe()}")
            time.sleep(0.2)

    def trained() -> list:
        return (
            [json.loads(line) for line in steps.read_text().splitlines()] if steps.exists() else []
        )

    try:
        wait_for(lambda: len(trained()) >= 5, 300)  # mid-epoch: 8 steps of 0.25 s an epoch
        signalled = slurm.run(["scancel", "--signal=TERM", "--batch", number], timeout=30)
        assert signalled.returncode == 0, signalled.stderr
        wait_for(lambda: _state(slurm, number) == "PD", 120)  # requeued by the script
        # ... and held back until its first run's credential expires (the cluster's
        # cred_expire: 30 s, Slurm's default 120 s)
        wait_for(lambda: _state(slurm, number) == "" and out.joinpath("rank1.json").exists(), 300)
    finally:
        slurm.run(["scancel", number], timeout=30)
    _check_resumed_with_no_step_redone(log.read_text(), number, trained(), out, describe)


def _check_resumed_with_no_step_redone(text, number, trained, out, describe) -> None:
    assert "hyparflow: preempted (SIGUSR1): saved" in text, describe()
    assert f"requeueing job {number}" in text and "run 1, on" in text, describe()
    assert [(s["epoch"], s["batch"]) for s in trained] == [
        (e, b) for e in range(3) for b in range(8)
    ], describe()  # every step once: the second run redid none
    for rank in (0, 1):
        result = json.loads(out.joinpath(f"rank{rank}.json").read_text())
        assert result["epochs"] == [0, 1, 2]
        assert result["weights"] < TOLERANCE, result
