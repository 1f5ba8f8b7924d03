"""Split a Keras functional or Sequential model into balanced pipeline stages."""

from hyparflow.partitioner.plan import BoundaryTensor, Plan, Stage
from hyparflow.partitioner.planner import partition

__all__ = ["BoundaryTensor", "Plan", "Stage", "partition"]
