"""hf.fit inside a Slurm job (started by srun or by mpirun in an sbatch script) against Keras.

Reports, besides the weight differences, what hyparflow.launch reads from Slurm's environment.
"""

import os

import keras

import hyparflow as hf
from hyparflow.launch import cpus_per_rank, local_rank, slurm_job
from tests.support.compare import relative_difference
from tests.support.models import compiled, data
from tests.support.report import report

BATCH, EPOCHS = 16, 2


def train(kind: str) -> float:
    x, y = data("mlp")
    reference = compiled("mlp", "adam")
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    model = compiled("mlp", "adam")
    hf.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, strategy=kind)
    return relative_difference(model.get_weights(), reference.get_weights())


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    job = slurm_job()
    report(
        {
            "rank": hf.rank(),
            "size": hf.size(),
            "weights": {kind: train(kind) for kind in ("data", "model")},
            "job": None if job is None else job.describe(),
            "job_id": None if job is None else job.job_id,
            "step_id": None if job is None else job.step_id,
            "local_rank": local_rank(),
            "slurm_procid": os.environ.get("SLURM_PROCID"),
            "cpus_per_rank": cpus_per_rank(),
            "intra_op_threads": os.environ.get("TF_NUM_INTRAOP_THREADS"),
        }
    )
