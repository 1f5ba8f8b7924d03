"""Which command launched this rank, as a hint spells it (pure: read from the environment)."""

from __future__ import annotations

from collections.abc import Mapping

# Set by `hyparflow run` in the environment its launcher inherits: the ranks' hints can then
# name the command the user typed (comm's `agree` errors: "launch with `hyparflow run -n 4`")
LAUNCHED_BY = "HYPARFLOW_LAUNCHED_BY"


def relaunch_command(environ: Mapping[str, str]) -> str:
    """The command that launched this rank, as a hint spells it, `{ranks}` for the count.

    Example:
        >>> relaunch_command({LAUNCHED_BY: "hyparflow run", "OMPI_COMM_WORLD_SIZE": "2"})
        'hyparflow run -n {ranks}'
        >>> relaunch_command({"SLURM_STEP_ID": "0"}), relaunch_command({})
        ('srun -n {ranks}', 'mpirun -np {ranks}')
    """
    if environ.get(LAUNCHED_BY) == "hyparflow run":
        return "hyparflow run -n {ranks}"
    if environ.get("SLURM_STEP_ID") is not None:
        return "srun -n {ranks}"
    return "mpirun -np {ranks}"
