"""Slurm's job, step and per-rank variables, read from the environment (no MPI, no Slurm API).

`srun` sets the per-task variables (SLURM_PROCID, SLURM_LOCALID) for every rank it starts. Ranks
that `mpirun` starts inside an `sbatch` script inherit the batch shell's values instead (the
same for every rank), so per-rank facts come from Open MPI's own variables first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "")
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class SlurmJob:
    """The Slurm job (and step, when `srun` started this process) a rank runs in."""

    job_id: str
    job_name: str | None
    node_list: str | None
    num_nodes: int | None
    num_tasks: int | None
    cpus_per_task: int | None
    step_id: str | None  # None in a batch script and in the ranks mpirun starts from it

    def describe(self) -> str:
        """One line for logs, e.g. "Slurm job 42 (train) step 0: 2 node(s) node[1-2], ..."."""
        parts = [f"Slurm job {self.job_id}"]
        if self.job_name:
            parts.append(f" ({self.job_name})")
        parts.append(f" step {self.step_id}" if self.step_id is not None else " batch")
        details = []
        if self.num_nodes is not None:
            details.append(f"{self.num_nodes} node(s) {self.node_list or ''}".rstrip())
        if self.num_tasks is not None:
            details.append(f"{self.num_tasks} task(s)")
        if self.cpus_per_task is not None:
            details.append(f"{self.cpus_per_task} CPU(s) per task")
        return "".join(parts) + (": " + ", ".join(details) if details else "")


def slurm_job(environ: Mapping[str, str] | None = None) -> SlurmJob | None:
    """The Slurm job this process belongs to, or None outside Slurm.

    For example:
        job = slurm_job()
        if job is not None and hf.rank() == 0:
            print(job.describe())
    """
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    return SlurmJob(
        job_id=job_id,
        job_name=env.get("SLURM_JOB_NAME"),
        node_list=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
        num_nodes=_int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES"),
        num_tasks=_int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS"),
        cpus_per_task=_int(env, "SLURM_CPUS_PER_TASK"),
        step_id=env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"),
    )


def local_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This rank's index among the ranks on its node (to pick its GPU), or None if unknown.

    Open MPI's `mpirun` sets OMPI_COMM_WORLD_LOCAL_RANK; `srun` sets SLURM_LOCALID per task
    (trusted only inside an srun step: a batch shell's value is inherited by every rank).

    For example:
        gpus = tf.config.list_physical_devices("GPU")
        if gpus and local_rank() is not None:
            tf.config.set_visible_devices(gpus[local_rank() % len(gpus)], "GPU")
    """
    env = os.environ if environ is None else environ
    found = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    if found is None and "OMPI_COMM_WORLD_SIZE" not in env and env.get("SLURM_STEP_ID"):
        found = _int(env, "SLURM_LOCALID")
    return found


def cpus_per_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """CPUs Slurm gave each task (`--cpus-per-task`), to size TensorFlow's thread pools; None
    when not set. `examples/slurm/train.sbatch` exports it as TF_NUM_INTRAOP_THREADS."""
    env = os.environ if environ is None else environ
    return _int(env, "SLURM_CPUS_PER_TASK")
