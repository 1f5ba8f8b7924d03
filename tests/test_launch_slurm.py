"""hyparflow.launch.slurm reads job, step, local rank and CPUs from Slurm's and Open MPI's
variables (pure: environments are given as dicts)."""

import pytest

from hyparflow.launch import cpus_per_rank, local_rank, slurm_job

SRUN_TASK = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_CPUS_PER_TASK": "4",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
}
# What mpirun's ranks inherit from the batch shell: no step, the shell's task ids.
BATCH_SHELL = {
    "SLURM_JOB_ID": "43",
    "SLURM_JOB_NODELIST": "node1",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


def test_outside_slurm():
    assert slurm_job({}) is None
    assert local_rank({}) is None
    assert cpus_per_rank({}) is None


def test_a_task_started_by_srun():
    job = slurm_job(SRUN_TASK)
    assert (job.job_id, job.step_id, job.num_nodes, job.num_tasks) == ("42", "0", 2, 8)
    assert job.describe() == (
        "Slurm job 42 (train) step 0: 2 node(s) node[1-2], 8 task(s), 4 CPU(s) per task"
    )
    assert local_rank(SRUN_TASK) == 1
    assert cpus_per_rank(SRUN_TASK) == 4


@pytest.mark.mpi
def test_ranks_mpirun_starts_in_a_batch_script():
    env = {**BATCH_SHELL, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    job = slurm_job(env)
    assert job.step_id is None
    assert job.describe() == "Slurm job 43 batch: 1 node(s) node1, 2 task(s)"
    assert local_rank(env) == 1  # Open MPI's, not the batch shell's SLURM_LOCALID 0
    assert local_rank(BATCH_SHELL) is None  # the shell's value is the same for every rank
