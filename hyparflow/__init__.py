"""hyparflow: data, model (pipeline) and hybrid parallel training of Keras 3 models over MPI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyparflow._lazy import lazy_names
from hyparflow.comm import uncaught
from hyparflow.comm.world import launched

__version__ = "0.1.0"

# The public names, imported on first use (PEP 562): `import hyparflow as hf; hf.fit(...)` works
# as before, while `hyparflow run` and `python -m hyparflow.run` start without TensorFlow.
_WHERE = {
    "NotHeldError": "hyparflow.deferred",
    "PREEMPTED_STATUS": "hyparflow.launch.preemption",
    "Plan": "hyparflow.partitioner",
    "Preempted": "hyparflow.launch.preemption",
    "Strategy": "hyparflow.strategy",
    "bind_gpus": "hyparflow.devices",
    "callbacks": None,  # a subpackage
    "data": None,
    "evaluate": "hyparflow.api",
    "export": "hyparflow.checkpoint",
    "fit": "hyparflow.api",
    "global_mean": "hyparflow.engine.keras_semantics.global_batch",
    "launch": None,
    "memory_plan": "hyparflow.memory",
    "partition": "hyparflow.api",
    "predict": "hyparflow.api",
    "rank": "hyparflow.comm.world",
    "scope": "hyparflow.deferred",
    "size": "hyparflow.comm.world",
}

__all__ = [
    "NotHeldError",
    "PREEMPTED_STATUS",
    "Plan",
    "Preempted",
    "Strategy",
    "bind_gpus",
    "callbacks",
    "data",
    "evaluate",
    "export",
    "fit",
    "global_mean",
    "launch",
    "memory_plan",
    "partition",
    "predict",
    "rank",
    "scope",
    "size",
]

if TYPE_CHECKING:  # what static tools and IDEs see
    from hyparflow import callbacks, data, launch
    from hyparflow.api import evaluate, fit, partition, predict
    from hyparflow.checkpoint import export
    from hyparflow.comm.world import rank, size
    from hyparflow.deferred import NotHeldError, scope
    from hyparflow.devices import bind_gpus
    from hyparflow.engine.keras_semantics.global_batch import global_mean
    from hyparflow.launch.preemption import PREEMPTED_STATUS, Preempted
    from hyparflow.memory import memory_plan
    from hyparflow.partitioner import Plan
    from hyparflow.strategy import Strategy


__getattr__, __dir__ = lazy_names(__name__, _WHERE)

if launched():  # under mpirun or srun: an uncaught exception on one rank ends the job
    uncaught.install()
