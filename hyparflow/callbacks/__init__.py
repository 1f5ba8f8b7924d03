"""hyparflow-aware Keras callbacks: checkpoints, the scaling profiler, the progress bar."""

from typing import TYPE_CHECKING

from hyparflow._lazy import lazy_names

# Imported on first use: `hyparflow report` reads what the profiler wrote without Keras.
_WHERE = {
    "Checkpoint": "hyparflow.callbacks.checkpoint",
    "ScalingProfiler": "hyparflow.callbacks.profiler",
    "ThroughputProgbarLogger": "hyparflow.callbacks.progress",
}
__all__ = ["Checkpoint", "ScalingProfiler", "ThroughputProgbarLogger"]

if TYPE_CHECKING:
    from hyparflow.callbacks.checkpoint import Checkpoint
    from hyparflow.callbacks.profiler import ScalingProfiler
    from hyparflow.callbacks.progress import ThroughputProgbarLogger

__getattr__, __dir__ = lazy_names(__name__, _WHERE)
