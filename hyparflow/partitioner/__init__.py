"""Split a Keras functional or Sequential model into balanced pipeline stages."""

from typing import TYPE_CHECKING

from hyparflow._lazy import lazy_names

# Imported on first use: the balance search and cost models are pure and load without Keras.
_WHERE = {
    "BoundaryTensor": "hyparflow.partitioner.plan",
    "Plan": "hyparflow.partitioner.plan",
    "Stage": "hyparflow.partitioner.plan",
    "partition": "hyparflow.partitioner.planner",
}
__all__ = ["BoundaryTensor", "Plan", "Stage", "partition"]

if TYPE_CHECKING:
    from hyparflow.partitioner.plan import BoundaryTensor, Plan, Stage
    from hyparflow.partitioner.planner import partition

__getattr__, __dir__ = lazy_names(__name__, _WHERE)
