"""hyparflow: data, model (pipeline) and hybrid parallel training of Keras 3 models over MPI."""

from hyparflow import callbacks, data, launch
from hyparflow.api import evaluate, fit, partition, predict
from hyparflow.checkpoint import export
from hyparflow.comm.world import rank, size
from hyparflow.deferred import NotHeldError, scope
from hyparflow.devices import bind_gpus
from hyparflow.memory import memory_plan
from hyparflow.partitioner import Plan
from hyparflow.strategy import Strategy

__version__ = "0.1.0"

__all__ = [
    "NotHeldError",
    "Plan",
    "Strategy",
    "bind_gpus",
    "callbacks",
    "data",
    "evaluate",
    "export",
    "fit",
    "launch",
    "memory_plan",
    "partition",
    "predict",
    "rank",
    "scope",
    "size",
]
