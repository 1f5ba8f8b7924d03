"""What the job launcher (Slurm, Open MPI's mpirun) tells each rank through its environment."""

from hyparflow.launch.slurm import SlurmJob, cpus_per_rank, local_rank, slurm_job

__all__ = ["SlurmJob", "cpus_per_rank", "local_rank", "slurm_job"]
